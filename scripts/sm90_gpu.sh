#!/usr/bin/env bash
# The sm_90a decode kernel on a Hopper GPU in one device call: ptxas' resource report, the JIT build, the GPU
# tests (float64, Triton, windows, CUDA graphs), then the decode benchmark with FlashMLA and vLLM's FP8 kernel
# side by side (their .so files from vLLM's wheel in FLASHMLA_LIB).
# usage (on the device): FLASHMLA_LIB=.data/flashmla bash scripts/sm90_gpu.sh [benchmark args...]
set -u
export PYTHONPATH=src:tests
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
(cd src/quantmla/kernels/hopper/csrc && nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -O3 -std=c++17 -Xptxas -v \
  -o /tmp/sm90.cubin decode_sm90.cu 2>&1 | grep -E "registers|spill|Potential|warning" | head -12)
start=$(date +%s)
python -c "from quantmla.kernels.hopper import extension; extension()" || exit 1
echo "build: $(( $(date +%s) - start )) s"
timeout 150 python -m pytest -q -rfEs -x -p no:cacheprovider tests/kernels/test_sm90_decode.py tests/cache/test_sm90_cache.py 2>&1 | tail -30
rc=${PIPESTATUS[0]}
echo "tests rc=$rc"
if [ "$rc" = 124 ]; then echo "tests timed out: no benchmark"; exit 1; fi
if [ "$rc" != 0 ] && [ -n "${PROBE_SWAP:-}" ]; then  # diagnosis: the N-major V descriptor with LBO and SBO swapped
  rm -rf /tmp/alt && mkdir -p /tmp/alt && cp -r src /tmp/alt/
  sed -i 's/sw128_desc(vbase + ks \* 16 \* 128, BLOCK_BYTES, 1024)/sw128_desc(vbase + ks * 16 * 128, 1024, BLOCK_BYTES)/' \
    /tmp/alt/src/quantmla/kernels/hopper/csrc/decode_sm90.cu
  grep -c "1024, BLOCK_BYTES" /tmp/alt/src/quantmla/kernels/hopper/csrc/decode_sm90.cu
  PYTHONPATH=/tmp/alt/src:tests timeout 200 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_sm90_decode.py \
    -k "float64_and_triton and c4r4" 2>&1 | tail -5
fi
timeout 400 python benchmarks/decode_attention.py --flashmla-lib "${FLASHMLA_LIB:-.data/flashmla}" \
  --json "$OUT/sm90.json" --out "$OUT/sm90.md" "$@" 2>&1 | grep -v '^{' | tail -40
if [ -n "${SPLITS:-}" ]; then  # the sm_90a kernel at other split counts (h=128, B=32, 64K, C4R4)
  python - "$SPLITS" <<'PY'
import sys, torch, triton.testing
sys.path.insert(0, "benchmarks")
from decode_attention import random_store
from quantmla.kernels.decode import mla_decode
g = torch.Generator(device="cuda").manual_seed(0)
store, bt, n = random_store("c4r4", 32, 65536, g)
q = torch.randn(32, 128, 512, device="cuda", generator=g).bfloat16()
qr = torch.randn(32, 128, 64, device="cuda", generator=g).bfloat16()
for ns in [None] + [int(x) for x in sys.argv[1].split(",")]:
    f = lambda: mla_decode(q, qr, store, bt, n, 0.07, kernel="sm90", num_splits=ns)
    us = triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median") * 1e3
    print(f"sm90 c4r4 h=128 B=32 64K splits={ns or 'plan'}: {us:.1f} us (eager)", flush=True)
PY
fi
if [ -n "${NCU:-}" ]; then  # Nsight Compute's view of one sm_90a launch at h=128, B=32, 64K (C4R4)
  cat > /tmp/one.py <<'PY'
import sys, torch
sys.path.insert(0, "benchmarks")
from decode_attention import random_store
from quantmla.kernels.decode import mla_decode
g = torch.Generator(device="cuda").manual_seed(0)
store, bt, n = random_store("c4r4", 32, 65536, g)
q = torch.randn(32, 128, 512, device="cuda", generator=g).bfloat16()
qr = torch.randn(32, 128, 64, device="cuda", generator=g).bfloat16()
for _ in range(3):
    mla_decode(q, qr, store, bt, n, 0.07, kernel="sm90")
torch.cuda.synchronize()
PY
  timeout 240 ncu --kernel-name regex:decode_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__cycles_active.avg \
    python /tmp/one.py 2>&1 | grep -v "^==PROF==" | grep -E "Throughput|Duration|Busy|Stall|hmma|inst_executed|cycles|Warp Cycles|Issued|Eligible" | cut -c1-150 | head -40
fi
