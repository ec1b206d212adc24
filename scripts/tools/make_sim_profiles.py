"""Write the simulator's profiles (profiles/sim/): the paper's OPT setups, and Llama-3 on H100 and H200.

    python -m scripts.tools.make_sim_profiles [--out DIR]      # default: profiles/sim

The FastServe paper's setups: OPT-13B on one A100, OPT-66B on four, OPT-175B
on sixteen, host<->GPU over PCIe 4.0. We have no A100 here, so each profile is
a roofline estimate from published datasheet numbers, stated in the file's
"source" field, not a measurement:
- NVIDIA A100 datasheet: 312 TFLOP/s dense FP16 tensor for both variants;
  HBM 1,555 GB/s (40GB SXM) or 2,039 GB/s (80GB SXM); we assume 50% of peak
  FLOP/s for prefill-like work and 70% of HBM bandwidth;
- PCIe 4.0 x16: 32 GB/s per direction raw; we assume 25 GB/s achieved;
- multi-GPU: compute and bandwidth scale with the GPU count at 80% efficiency
  (tensor-parallel all-reduces, pipeline bubbles);
- KV capacity: 90% of GPU memory minus the FP16 weights; host swap space 256 GiB.
A measured profile from `fastserve profile` on real hardware replaces these.

Two variants per setup, because the GPU's memory decides whether KV memory
binds: A100 40GB, the GPU of the vLLM paper's OPT-13B/66B setups (its Table 1:
12 GB of KV for OPT-13B) and of AWS p4d.24xlarge nodes (8 x A100 40GB, so
sixteen GPUs are two nodes), and A100 80GB.

Llama-3 setups: Llama-3-8B on one H100 80GB (SXM) and on one H200, Llama-3-70B
on eight H100s with tensor parallelism 8 (one HGX H100 node), BF16 weights and
KV, from Meta's config.json (modelmaker/llama_checkpoint.py LLAMA_SHAPES).
Grouped-query attention: 8 KV heads of 128, so a token's KV is 2 x layers x 8
x 128 x 2 bytes (128 KiB for 8B, 320 KiB for 70B); the gated MLP's three
matrices are in the parameter count (8.03B, 70.55B). Roofline estimates from
published datasheet numbers, not measurements:
- NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 989 TFLOP/s dense BF16
  tensor (1,979 with sparsity), HBM3 3.35 TB/s, 80 GB;
- NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 989 TFLOP/s dense BF16
  tensor (1,979 with sparsity), HBM3e 4.8 TB/s, 141 GB;
- the A100 profiles' efficiencies: 50% of peak FLOP/s, 70% of HBM bandwidth;
- tensor parallelism 8: each GPU does 1/8 of the FLOPs and reads 1/8 of the
  weights and KV (no 80% factor), plus two all-reduces a layer (after the
  attention and after the MLP) of the batch's hidden states, tokens x hidden
  x 2 bytes: a ring all-reduce moves 2 x 7/8 of them over each GPU's NVLink 4,
  450 GB/s a direction (the datasheets' 900 GB/s counts both), 70% achieved,
  plus 10 us of latency each;
- PCIe 5.0 x16 (the datasheets' 128 GB/s counts both directions): 64 GB/s a
  direction raw; we assume 50 GB/s achieved, per GPU;
- KV capacity: 90% of GPU memory (80 and 141 GiB, the datasheets' GB read as
  GiB as for the A100s) minus the BF16 weights; host swap space 256 GiB.
As for the A100s, a measured profile from `fastserve profile` replaces these.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.analytic_profile import roofline_profile
from engine.model.config import OPTConfig
from engine.model.llama_config import LlamaConfig
from modelmaker.llama_checkpoint import LLAMA_SHAPES, llama_config
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config

REPO = Path(__file__).resolve().parents[2]

A100_FLOPS = 312e12
A100_VARIANTS = {"40gb": (1.555e12, 40 * 2**30), "80gb": (2.039e12, 80 * 2**30)}  # HBM bytes/s, memory
FLOP_EFF, BW_EFF, SCALE_EFF = 0.5, 0.7, 0.8
PCIE_BYTES = 25e9
HOST_KV = 256 * 2**30
SETUPS = [("opt-13b", 1, 1), ("opt-66b", 4, 1), ("opt-175b", 8, 2)]  # (model, tp, pp)

# Llama-3: (dense BF16 FLOP/s, HBM bytes/s, memory, the device name as torch reports it), from the datasheets
HOPPER = {"h100-80gb": (989e12, 3.35e12, 80 * 2**30, "NVIDIA H100 80GB HBM3"),
          "h200-141gb": (989e12, 4.8e12, 141 * 2**30, "NVIDIA H200")}
NVLINK_BYTES, NVLINK_EFF, ALLREDUCE_LATENCY_S = 450e9, 0.7, 10e-6  # NVLink 4, one direction
PCIE5_BYTES = 50e9
_DOC = __doc__.strip().splitlines()
_LLAMA_AT = next(i for i, line in enumerate(_DOC) if line.startswith("Llama-3 setups:"))
OPT_SOURCE, LLAMA_SOURCE = _DOC[5:_LLAMA_AT - 1], _DOC[_LLAMA_AT:]  # each profile's "source" field
LLAMA_SETUPS = [("llama-3-8b", "h100-80gb", 1), ("llama-3-8b", "h200-141gb", 1), ("llama-3-70b", "h100-80gb", 8)]


def profile_name(name: str, variant: str, gpus: int) -> str:
    return f"{name}-a100-{variant}-x{gpus}.json"


def allreduce_s(tokens: int, hidden: int, tp: int, layers: int) -> float:
    """The tensor-parallel all-reduces of one iteration over `tokens` tokens: two a layer of tokens x hidden BF16
    values, a ring moving 2 (tp - 1) / tp of them over each GPU's NVLink, plus a fixed latency each."""
    if tp == 1:
        return 0.0
    moved = 2 * (tp - 1) / tp * tokens * hidden * 2
    return 2 * layers * (ALLREDUCE_LATENCY_S + moved / (NVLINK_BYTES * NVLINK_EFF))


def llama_profile(name: str, gpu: str, tp: int) -> dict:
    """The roofline profile of Llama-3 shape `name` on `tp` GPUs of kind `gpu` (HOPPER) with tensor parallelism."""
    flops, hbm_bytes, memory, device = HOPPER[gpu]
    cfg = LlamaConfig.from_dict(llama_config(**LLAMA_SHAPES[name]), "LlamaForCausalLM", name=name)
    key = {"model": name, "dtype": "bfloat16", "tensor_parallel_size": tp, "pipeline_parallel_size": 1,
           "hardware": f"cuda: {tp}x {device} (roofline estimate)"}
    prof = roofline_profile(cfg, flops * FLOP_EFF * tp, hbm_bytes * BW_EFF * tp, 2, key, overhead_per_layer_s=2e-5)
    ar = lambda n: allreduce_s(n, cfg.hidden_size, tp, cfg.num_hidden_layers)  # noqa: E731
    pre, dec, fwd = prof["prefill"], prof["decode"], prof["forward"]
    pre["seconds"] = [t + ar(n) for n, t in zip(pre["prompt_lens"], pre["seconds"])]
    dec["seconds"] = [[t + ar(b) for t in row] for b, row in zip(dec["batch_sizes"], dec["seconds"])]
    fwd["seconds"] = [t + ar(n) for n, t in zip(fwd["tokens"], fwd["seconds"])]
    prof["transfer"] = {"host_to_device_bytes_per_s": PCIE5_BYTES * tp, "device_to_host_bytes_per_s": PCIE5_BYTES * tp}
    prof["capacity"] = {"device_kv_bytes": max(0.0, 0.9 * memory * tp - cfg.num_params() * 2),
                        "host_kv_bytes": HOST_KV}
    prof["source"] = LLAMA_SOURCE
    return prof


def report(path: Path, prof: dict) -> str:
    return (f"wrote {path}: t_init(512) {prof['prefill']['seconds'][5]:.4f} s, "
            f"t_dec(1, 16) {prof['decode']['seconds'][0][0]:.4f} s, "
            f"KV {prof['capacity']['device_kv_bytes'] / 2**30:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "profiles" / "sim", help="where to write the profiles")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, gpu, tp in LLAMA_SETUPS:
        path = args.out / f"{name}-{gpu}-x{tp}.json"
        prof = llama_profile(name, gpu, tp)
        path.write_text(json.dumps(prof, indent=1) + "\n")
        print(report(path, prof))
    for variant, (hbm_bytes, memory) in A100_VARIANTS.items():
        for name, tp, pp in SETUPS:
            cfg = OPTConfig.from_dict(opt_config(**OPT_SHAPES[name]), name=name)
            gpus = tp * pp
            scale = gpus * (SCALE_EFF if gpus > 1 else 1.0)
            key = {"model": name, "dtype": "float16", "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                   "hardware": f"cuda: {gpus}x NVIDIA A100-SXM4-{variant.upper()} (roofline estimate)"}
            prof = roofline_profile(cfg, A100_FLOPS * FLOP_EFF * scale, hbm_bytes * BW_EFF * scale, 2, key,
                                    overhead_per_layer_s=2e-5)
            weights = cfg.num_params() * 2
            prof["transfer"] = {"host_to_device_bytes_per_s": PCIE_BYTES * gpus,
                                "device_to_host_bytes_per_s": PCIE_BYTES * gpus}
            prof["capacity"] = {"device_kv_bytes": max(0.0, 0.9 * memory * gpus - weights), "host_kv_bytes": HOST_KV}
            prof["source"] = OPT_SOURCE
            path = args.out / profile_name(name, variant, gpus)
            path.write_text(json.dumps(prof, indent=1) + "\n")
            print(report(path, prof))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
