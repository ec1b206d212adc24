"""Registers, spills and shared memory of every Triton kernel (fastserve_kernels/triton_attention.py), compiled for an
NVIDIA GPU without one.

    .venv/bin/python -m scripts.triton_registers [--arch 90] [--block-size 16] [--heads 32,8]

Each kernel is compiled as the host code launches it (its tile sizes, num_warps and argument types for a dtype
and head dim) with triton.compile(ASTSource, GPUTarget("cuda", arch, 32)): Triton's front end, LLVM, PTX and
the ptxas in the triton wheel (triton/backends/nvidia/bin). Register and spill counts are read from ptxas -v,
run again on the compiled PTX with the flags Triton's own make_cubin passes (-lineinfo --regAllocOptLevel=2
--gpu-name=sm_90a): a compiled kernel's n_regs / n_spills are only filled in when it is loaded on a device.
Needs TRITON_INTERPRET unset. tests/test_triton_kernels.py checks the limits with compile_kernels."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# (dtype, head dim) of the configurations that serve: OPT-125m/1.3b/6.7b (D = 64, 80 for 2.7b), 13b and up (128).
CONFIGS = [(torch.float16, 64), (torch.float16, 80), (torch.float16, 128), (torch.bfloat16, 128),
           (torch.float32, 64), (torch.float32, 128)]
TYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    name: str
    num_warps: int
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared: int  # bytes of shared memory (Triton's metadata)


def attention_module():
    """fastserve_kernels.triton_attention, compiled (not interpreted)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile the kernels")
    name = "fastserve_kernels.triton_attention"
    module = sys.modules.get(name) or importlib.import_module(name)
    if module.INTERPRETED:
        module = importlib.reload(module)
    assert not module.INTERPRETED, "unset TRITON_INTERPRET to compile the kernels"
    return module


# (heads, head dim) of a model with each head dim: OPT-1.3b (32 x 64), OPT-2.7b (32 x 80), OPT-13b (40 x 128).
HEADS = {64: 32, 80: 32, 128: 40}


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch instead of running."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


def launches(module, dtype: torch.dtype, d: int, bs: int, layers: int = 4, heads: tuple[int, int] | None = None):
    """Every kernel launch of one layer's fastserve_kernels.triton_attention.paged_attention, as the host code makes it,
    on meta tensors (no memory, no device): a batch of fresh prefills (one longer than a query tile), a chunked
    prefill after a cached prefix and decode rows with contexts up to 2,048 tokens, over a cache of a model
    with this head dim (HEADS: as many KV heads as query heads) or these (query heads, KV heads), in `dtype`.
    Returns [(kernel, grid, args, kwargs)]."""
    from fastserve_kernels.paged_attention import AttentionMetadata

    h, h_kv = heads or (HEADS.get(d, 32),) * 2
    seqs = [(0, 300), (0, 7), (700, 90), (1000, 1), (2047, 1), (15, 1), (40, 1)]  # (cached, new)
    tables, next_block = [], 0
    for cached, new in seqs:
        n = -(-(cached + new) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    meta = AttentionMetadata.for_sequences(seqs, tables, bs).to("meta")
    t = sum(new for _, new in seqs)
    qkv = torch.empty(t, h + 2 * h_kv, d, dtype=dtype, device="meta")  # the model's fused projection: q, k, v are views
    q, k, v = qkv.split([h, h_kv, h_kv], dim=1)
    kv_cache = torch.empty(next_block + 64, layers, 2, h_kv, bs, d, dtype=dtype, device="meta")
    with recording(module) as recorded:
        module.paged_attention(q, k, v, kv_cache, layers - 1, meta, d**-0.5)
    return recorded


KERNELS = ["_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"]


@contextlib.contextmanager
def recording(module):
    """Inside: every kernel launch of `module` (fastserve_kernels.triton_attention) is recorded in the list yielded,
    as (kernel, grid, args, kwargs), instead of run; call the host code on meta tensors."""
    recorded: list = []
    real = {name: getattr(module, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(module, name, _Recorder(real[name], recorded))
        module.forget_last_step()
        yield recorded
    finally:
        for name in KERNELS:
            setattr(module, name, real[name])
        module.forget_last_step()


def specializations(launches) -> set[tuple]:
    """The distinct compilations of these launches, as Triton keys them: one a (kernel, signature, constexprs,
    divisibility attributes, options). Each is one compiled kernel (one *.cubin) on an empty cache."""
    keys = set()
    for kernel, _grid, args, kwargs in launches:
        signature, constexprs, attrs, options = specialize(kernel, args, dict(kwargs))
        keys.add((kernel.fn.__name__, *(repr(sorted(x.items())) for x in (signature, constexprs, attrs, options))))
    return keys


def kernel_test_launches(module) -> list:
    """The launches of tests/test_triton_kernels.py's compiled-kernel test on CUDA (its dtypes, head dims, batch
    and both decode split sizes), recorded on meta tensors: what the device check's kernels step compiles."""
    from tests.paged_batches import make_batch

    seqs = [(0, 1), (0, 200), (15, 1), (16, 1), (17, 1), (1500, 1), (100, 37), (64, 130), (2047, 1)]
    launches = []
    for dtype in (torch.float16, torch.float32):
        for d in (64, 80, 128):
            q, k, v, kv, meta, _ = make_batch(seqs, h=6, d=d, bs=16, dtype=dtype, seed=5, h_kv=2)
            q, k, v, kv, meta = (x.to("meta") for x in (q, k, v, kv, meta))
            with recording(module) as recorded:
                module.paged_attention(q, k, v, kv, 1, meta, d**-0.5)
                for tokens_per_split in (64, 256):
                    module.decode_attention(q, kv, 1, meta.decode_token_index, meta.decode_block_tables,
                                            meta.decode_context_lens, d**-0.5, torch.empty_like(q), tokens_per_split)
            launches += recorded
    return launches


def specialize(kernel, args, kwargs):
    """(signature, constexprs, attrs, options) for triton.compile, as Triton's launcher derives them from the
    arguments: constexpr parameters, ints equal to 1 as constants, 16-divisible ints and 16-byte aligned
    pointers marked tt.divisibility (meta tensors' data_ptr is 0: aligned, as CUDA allocations are)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = list(inspect.signature(kernel.fn).parameters)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    bound = dict(zip(params, args)) | kwargs
    assert set(bound) == set(params), (kernel.fn.__name__, set(params) ^ set(bound))
    constexpr_names = {params[i] for i in kernel.constexprs}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        value = bound[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":
            signature[name], constexprs[name] = "constexpr", spec
            continue
        signature[name] = ty
        if spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs, options


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v on one kernel's PTX, with Triton's flags: registers, spill store/load bytes, stack frame bytes."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path if "arch" in inspect.signature(get_ptxas).parameters else get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        run = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True, check=True)
    log = run.stderr + run.stdout
    found = {
        "registers": re.search(r"Used (\d+) registers", log),
        "stack": re.search(r"(\d+) bytes stack frame", log),
        "spill_stores": re.search(r"(\d+) bytes spill stores", log),
        "spill_loads": re.search(r"(\d+) bytes spill loads", log),
    }
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise RuntimeError(f"ptxas -v printed no {missing}:\n{log}")
    return {k: int(m.group(1)) for k, m in found.items()}


def compile_kernels(arch: int, dtype: torch.dtype, d: int, bs: int = 16, module=None,
                    aligned: bool = True, heads: tuple[int, int] | None = None) -> dict[str, KernelBuild]:
    """Every kernel, as launches() records it, compiled for compute capability `arch` (no GPU needed), with its
    resource usage. A kernel launched twice with different specializations keeps its larger register count.
    aligned=False drops the divisibility hints (tt.divisibility), as for a launch whose pointers or strides are
    not multiples of 16: no vectorized loads, the worst case. heads: (query heads, KV heads), as launches()."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = module or attention_module()
    builds: dict[str, KernelBuild] = {}
    for kernel, _grid, args, kwargs in launches(module, dtype, d, bs, heads=heads):
        signature, constexprs, attrs, options = specialize(kernel, args, dict(kwargs))
        attrs = attrs if aligned else {}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        name = kernel.fn.__name__
        assert compiled.asm["cubin"], name
        usage = ptxas_usage(compiled.asm["ptx"], arch)
        build = KernelBuild(name=name, num_warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
                            **usage)
        if name not in builds or build.registers > builds[name].registers:
            builds[name] = build
    return builds


def load_module(path: str):
    """A version of fastserve_kernels/triton_attention.py from a file
    (e.g. `git show REV:fastserve_kernels/triton_attention.py`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"triton_attention_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton's JIT looks its kernels' module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90 (default 90)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--module", help="another version of fastserve_kernels/triton_attention.py to measure, e.g. "
                        "git show HEAD~1:fastserve_kernels/triton_attention.py > /tmp/old.py; --module /tmp/old.py")
    parser.add_argument("--unaligned", action="store_true", help="without the launch's divisibility hints")
    parser.add_argument("--heads", help="query heads,KV heads (e.g. 32,8: grouped-query attention); default: each "
                        "head dim's OPT model, as many KV heads as query heads")
    parser.add_argument("--count-kernel-tests", action="store_true", help="only count the kernels the device check's "
                        "kernels step compiles (tests/test_triton_kernels.py on CUDA), by kernel")
    args = parser.parse_args()
    module = load_module(args.module) if args.module else None
    heads = tuple(int(x) for x in args.heads.split(",")) if args.heads else None
    if heads is not None and (len(heads) != 2 or heads[1] < 1 or heads[0] % heads[1]):
        parser.error(f"--heads {args.heads}: give query heads,KV heads, the first a multiple of the second")
    if args.count_kernel_tests:
        keys = specializations(kernel_test_launches(module or attention_module()))
        by_kernel = collections.Counter(key[0] for key in keys)
        print(f"{len(keys)} specializations: " + ", ".join(f"{n} {name}" for name, n in sorted(by_kernel.items())))
        return
    print("| dtype | D | kernel | warps | registers | spill stores / loads (bytes) | stack | shared |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, d in CONFIGS:
        builds = compile_kernels(args.arch, dtype, d, args.block_size, module=module, aligned=not args.unaligned,
                                 heads=heads)
        for b in builds.values():
            print(f"| {TYPE_NAMES[dtype]} | {d} | {b.name} | {b.num_warps} | {b.registers} | "
                  f"{b.spill_stores} / {b.spill_loads} | {b.stack} | {b.shared} |")


if __name__ == "__main__":
    main()
