#!/usr/bin/env bash
# Issue 19 on the H200 in one device call: ptxas' resource report of the prototypes, the Hopper extension's JIT
# build, the fragment probe and the h = 16 prototypes against float64 (tests/kernels/test_hopper_probe.py), the
# prototypes' timing side by side (prototypes/kernel_v3/tile_h16_bench.py), then Nsight Compute's view of the
# pipelined one (one launch; its report into $OUT when set).
# usage (on the device): bash prototypes/kernel_v3/gpu.sh
set -u
export PYTHONPATH=src:prototypes
for f in tile_h16 stream_h16 stream_h16_cs; do
  echo "== ptxas $f"
  nvcc -gencode arch=compute_90a,code=sm_90a -cubin -O3 -std=c++17 --use_fast_math -Xptxas -v -o /tmp/$f.cubin \
    prototypes/kernel_v3/hopper/$f.cu 2>&1 | grep -E "registers|spill|stack|Potential"
  echo "SASS instructions of $f (static, top 24):"  # the loop body's mix; the step loop runs once a 64-token step
  cuobjdump -sass /tmp/$f.cubin | grep -oE '^\s+/\*[0-9a-f]{4,5}\*/\s+[A-Z][A-Z0-9._]*' | awk '{print $2}' |
    sed -E 's/\..*//' | sort | uniq -c | sort -rn | head -24 | paste -sd' '
done
python -m pytest -q -rfEs prototypes/kernel_v3/tests 2>&1 | tail -25 | cut -c1-200
python prototypes/kernel_v3/tile_h16_bench.py --per-cta ${PER_CTA:-4096 8000 8192 16384}
for k in ${NCU_KERNELS:-stream-v3 stream-v5}; do
  echo "== ncu $k"
  ncu --kernel-name regex:stream_h16 --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section InstructionStats \
    --section ComputeWorkloadAnalysis --section SchedulerStats \
    --metrics "smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python prototypes/kernel_v3/tile_h16_bench.py --per-cta 8000 --kernels $k 2>&1 | grep -v "^==PROF==" |
    grep -E "Executed Ipc E|Issue Slots Busy|Memory Throughput|Max Bandwidth|highest-utilized|Eligible Warps|Registers Per|Block Limit|smsp__" |
    grep -vE "_ratio\s+inst\s+0(\.0[0-4])?$" | cut -c1-140  # the headline counters; stalls >= 0.05 a cycle
done
