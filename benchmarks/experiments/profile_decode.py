"""Launch one decode-kernel configuration a few times, for a profiler (ncu) to capture.

On the lent H200 (Firecracker runtime) ncu reads the hardware counters when it leaves the clocks
alone; the stall reasons and shared-memory traffic behind BENCHMARKS.md's diagnosis come from:

    export PYTHONPATH=src:benchmarks
    ncu --clock-control none --kernel-name regex:lowbit_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy \
        --metrics $(python benchmarks/experiments/profile_decode.py --metrics) \
        python benchmarks/experiments/profile_decode.py --scheme c4r4 --heads 16
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from decode_attention import DC, DR, random_store

from quantmla.kernels.decode import mla_decode

STALLS = (
    "barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait not_selected "
    "selected dispatch_stall no_instruction"
).split()
METRICS = [f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in STALLS] + [
    "smsp__inst_executed.sum",
    "smsp__warps_active.avg.per_cycle_active",
    "sm__cycles_elapsed.avg",
    "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
]


def main() -> None:
    if "--metrics" in sys.argv:  # the ncu metric list, comma-separated
        print(",".join(METRICS))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="c4r4")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    store, bt, n_paged = random_store(args.scheme, args.batch, args.context, gen)
    q = torch.randn(args.batch, args.heads, DC, device="cuda", generator=gen).bfloat16()
    qr = torch.randn(args.batch, args.heads, DR, device="cuda", generator=gen).bfloat16()
    for _ in range(args.launches):
        mla_decode(q, qr, store, bt, n_paged, 1 / math.sqrt(192))
    torch.cuda.synchronize()
    k = mla_decode.last_kernel
    print(f"{args.scheme}: registers {getattr(k, 'n_regs', '?')}, spills {getattr(k, 'n_spills', '?')}")


if __name__ == "__main__":
    main()
