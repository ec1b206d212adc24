"""Write the simulator's profiles for the paper's setups (profiles/sim/).

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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.analytic_profile import roofline_profile
from engine.model.config import OPTConfig
from modelmaker.opt_checkpoint import OPT_SHAPES, opt_config

REPO = Path(__file__).resolve().parents[2]

A100_FLOPS = 312e12
A100_VARIANTS = {"40gb": (1.555e12, 40 * 2**30), "80gb": (2.039e12, 80 * 2**30)}  # HBM bytes/s, memory
FLOP_EFF, BW_EFF, SCALE_EFF = 0.5, 0.7, 0.8
PCIE_BYTES = 25e9
HOST_KV = 256 * 2**30
SETUPS = [("opt-13b", 1, 1), ("opt-66b", 4, 1), ("opt-175b", 8, 2)]  # (model, tp, pp)


def profile_name(name: str, variant: str, gpus: int) -> str:
    return f"{name}-a100-{variant}-x{gpus}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "profiles" / "sim", help="where to write the profiles")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
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
            prof["source"] = __doc__.strip().splitlines()[5:22]
            path = args.out / profile_name(name, variant, gpus)
            path.write_text(json.dumps(prof, indent=1) + "\n")
            print(f"wrote {path}: t_init(512) {prof['prefill']['seconds'][5]:.4f} s, "
                  f"t_dec(1, 16) {prof['decode']['seconds'][0][0]:.4f} s, "
                  f"KV {prof['capacity']['device_kv_bytes'] / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
