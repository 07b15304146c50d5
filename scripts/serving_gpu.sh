#!/usr/bin/env bash
# The vLLM serving runs on an H100 or H200, from the tree: PYTHONPATH=src, vLLM's wheels in /tmp/site
# (.wheels: vLLM 0.26, scripts/vllm_gpu_wheels.sh; WHEELS=.wheels033: vLLM 0.33, scripts/vllm033_gpu_wheels.sh).
#
#   bash scripts/serving_gpu.sh setup          once per machine: install .wheels (scripts/vllm_gpu_wheels.sh; its parts
#                                              copied to /tmp/wheel-parts first; WHEELS=DIR: another bundle, e.g.
#                                              vLLM 0.33's with torch 2.14) and quantmla's plugin entry point
#   bash scripts/serving_gpu.sh kernels        the kernel and window tests on the GPU (against torch and float64)
#   bash scripts/serving_gpu.sh sweep          the decode kernel the engine's way (engine_splits.py): fixed split
#                                              counts SPLITS, float16 partials, the combine's steps CHUNKS and
#                                              launches LAUNCHES (BLOCK_T/WARPS/STAGES) on CASES; needs no vLLM, so
#                                              it can share the first wheel-part call
#   bash scripts/serving_gpu.sh test [ARGS]    tests/serving/test_vllm_gpu.py (a random DeepSeek-V2, BF16, CUDA graphs)
#                                              and test_vllm_gpu_fp8_export.py (FP8 V3-config exports in vLLM); about
#                                              17 engines (60-100 s each), over 10 minutes: ARGS (pytest's) split
#                                              them over calls (each test starts only the engines it reads), e.g.
#                                              `tests/serving/test_vllm_gpu.py -k "not prefix and not mtp and not
#                                              codec"`, then `-k "prefix or mtp or codec"` (TRIAL_CODECS=1 for the
#                                              codecs, TRIAL_SPEC=1 for MTP on 0.33), then the FP8 export file
#   bash scripts/serving_gpu.sh decode         decode attention alone: vLLM's FA3 MLA vs quantmla's kernels
#                                              (DECODE_CASES: requests x context, comma list)
#   bash scripts/serving_gpu.sh pressure S B   benchmarks/serving_pressure.py on DeepSeek-V2-Lite (dummy weights;
#                                              MODEL=deepseek-v3-width-128h-dummy: 128 heads, V3's DP-attention shape),
#                                              each workload (WORKLOADS) its own engine of max_num_seqs = its requests
#                                              rounded up to a multiple of 8
#                                              (SEQS=N: one engine of N), windows WINDOWS (default 4,128),
#                                              BATCHED=N: vLLM's max_num_batched_tokens (default vLLM's),
#                                              STEPLOG=1: each engine step's mix and time (--step-log),
#                                              ROUNDS=N: the workloads N times over, round-robin (medians),
#                                              REFERENCE=S@MIB: the medians as a share of S's at MIB,
#                                              schemes S (comma list) at budgets B (MiB, comma list)
#   bash scripts/serving_gpu.sh profile S B    the pressure run of scheme S at budget B MiB (WORKLOADS, default
#                                              5x32768+1024; SEQS default 8; BATCHED default 163840: every prefill
#                                              in the first step) under vLLM's torch profiler for STEPS (12) engine
#                                              steps from the start; scripts/profile_summary.py's table, the trace
#                                              and vLLM's kernel table into $OUT/serving-gpu/profile-S*
#   bash scripts/serving_gpu.sh serve          `vllm serve` on a DeepSeek-V2-Lite directory (dummy weights, the bundled
#                                              tokenizer) whose quantmla.json asks for C4R4: two /v1/completions
#                                              requests, the server's quantmla log lines, then the server stops
# Results go to ${OUT:-out}/serving-gpu/serving.json (appended); --report prints the table.
set -euo pipefail
# TRIAL_VLLM=X.Y: the first GPU runs of a vLLM the plugin's CUDA path is written for but not yet listed as supported
# (compat.SUPPORTED): this machine's copy of the tree lists it for the run
if [ -n "${TRIAL_VLLM:-}" ]; then
  sed -i "s/^SUPPORTED = (\(.*\))$/SUPPORTED = (\1, (\"$TRIAL_VLLM\", \"cuda\"))/" src/quantmla/serving/vllm/compat.py
  grep -q "\"$TRIAL_VLLM\", \"cuda\"" src/quantmla/serving/vllm/compat.py || { echo "TRIAL_VLLM: compat.SUPPORTED not as expected" >&2; exit 2; }
fi
# TRIAL_SPEC=1: the first GPU runs of speculative decoding on a vLLM where it is refused until then
# (compat.SPECULATIVE_UNTESTED), allowed in this copy
if [ -n "${TRIAL_SPEC:-}" ]; then
  sed -i "s/^SPECULATIVE_UNTESTED = .*$/SPECULATIVE_UNTESTED = ()/" src/quantmla/serving/vllm/compat.py
  grep -q "^SPECULATIVE_UNTESTED = ()$" src/quantmla/serving/vllm/compat.py || { echo "TRIAL_SPEC: compat.SPECULATIVE_UNTESTED not as expected" >&2; exit 2; }
fi
# what `setup` found the installed torch needs from this image (/tmp/site-env.sh): vLLM 0.33's torch 2.14 is built
# with cuDNN 9.24 and NCCL 2.30 where the image has 9.19 and 2.28 (scripts/vllm033_gpu_wheels.sh)
[ -f /tmp/site-env.sh ] && . /tmp/site-env.sh
# TRIAL_CODECS=1: the first GPU runs of per-layer codecs on CUDA (selection.CUDA_CODECS), turned on in this copy
if [ -n "${TRIAL_CODECS:-}" ]; then
  sed -i "s/^CUDA_CODECS = False$/CUDA_CODECS = True/" src/quantmla/serving/vllm/selection.py
  grep -q "^CUDA_CODECS = True$" src/quantmla/serving/vllm/selection.py || { echo "TRIAL_CODECS: selection.CUDA_CODECS not as expected" >&2; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
# the test process may have initialised CUDA before vLLM forks its engine core
export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn}
out=${OUT:-out}/serving-gpu
mkdir -p "$out"
[ -f /tmp/serving.json ] && [ ! -f "$out/serving.json" ] && cp /tmp/serving.json "$out/serving.json"
# NCCL entry points the installed torch imports and the image's NCCL lacks (2.30's, for a 2.28 image): stubs that
# return ncclInvalidUsage, preloaded so torch imports; a one-GPU engine calls none of them (tensor parallel would:
# it needs the matching NCCL). Written to /tmp/site-env.sh with cuDNN's version check off (no MLA path calls cuDNN).
image_stubs() {
  local nccl
  PYTHONPATH=/tmp/site python -c "import torch" 2> /tmp/torch-import.err && return 0
  grep -q "undefined symbol: nccl" /tmp/torch-import.err || { cat /tmp/torch-import.err >&2; return 1; }
  nccl=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')
  nm -D --defined-only "$nccl" | awk '{print $3}' | sed 's/@.*//' | sort -u > /tmp/nccl-have
  nm -D --undefined-only /tmp/site/torch/lib/libtorch_cuda.so | awk '{print $2}' | sed 's/@.*//' \
    | grep '^nccl' | sort -u > /tmp/nccl-want
  mkdir -p /tmp/ncclshim
  comm -23 /tmp/nccl-want /tmp/nccl-have | awk '{print "int " $1 "(void) { return 5; }"}' > /tmp/ncclshim/stubs.c
  gcc -shared -fPIC -o /tmp/ncclshim/libncclstubs.so /tmp/ncclshim/stubs.c
  printf 'export LD_PRELOAD=/tmp/ncclshim/libncclstubs.so PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1\n' > /tmp/site-env.sh
  echo "setup: torch needs NCCL entry points $nccl lacks: stubbed ($(grep -c . /tmp/ncclshim/stubs.c)):" \
    "$(comm -23 /tmp/nccl-want /tmp/nccl-have | tr '\n' ' ')"
  . /tmp/site-env.sh
}
case "${1:-}" in
setup)
  bash "${WHEELS:-.wheels}/install.sh"
  d=/tmp/site/quantmla_tree-0.dist-info
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: quantmla-tree\nVersion: 0\n' > "$d/METADATA"
  printf '[vllm.general_plugins]\nquantmla = quantmla.serving.vllm:register\n' > "$d/entry_points.txt"
  image_stubs
  python -c "import vllm; print('vllm', vllm.__version__)";;
sweep)
  python benchmarks/experiments/engine_splits.py --splits "${SPLITS:-4,6,8,11,16,22,64,128}" --fp16-partials \
    --chunks "${CHUNKS:-32,64,128}" --launches "${LAUNCHES:-32/4/2,32/4/3,64/8/2,64/4/3}" \
    --json "$out/engine-splits.json" \
    --cases "${CASES:-48x4096/48/33792,40x4096/48/33792,5x32768/8/33792,8x32768/8/33792,1x4096/1/33792,1x32768/1/33792,8x131072/8/132096}" \
    | grep "^|";;
kernels)
  python -m pytest -q -p no:cacheprovider tests/kernels tests/serving/test_shadow_kernels.py tests/serving/test_windows.py;;
test)
  shift
  [ $# -gt 0 ] || set -- tests/serving/test_vllm_gpu.py tests/serving/test_vllm_gpu_fp8_export.py
  # the tests sample greedily: no FlashInfer top-p/top-k sampler, which a fresh machine JIT-builds at the first
  # engine's warm-up (the likely cause of the 146 s one spent after its first graph capture; not yet confirmed)
  export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
  python -m pytest -q -s -p no:cacheprovider "$@";;
decode)
  python benchmarks/serving_pressure.py --out "$out" --append --decode-only --repeats 20 \
    ${DECODE_CASES:+--decode-cases "$DECODE_CASES"};;
pressure)
  python benchmarks/serving_pressure.py --out "$out" --append --model "${MODEL:-deepseek-v2-lite-dummy}" --schemes "$2" \
    --budgets-mib "$3" --workloads "${WORKLOADS:-5x32768+1024,48x4096+2048}" --max-num-seqs "${SEQS:-0}" \
    --windows "${WINDOWS:-4,128}" --max-num-batched-tokens "${BATCHED:-0}" --rounds "${ROUNDS:-1}" \
    ${REFERENCE:+--reference "$REFERENCE"} ${STEPLOG:+--step-log};;
profile)
  rm -rf "/tmp/prof/$2"
  python benchmarks/serving_pressure.py --out "$out" --append --model deepseek-v2-lite-dummy --schemes "$2" \
    --budgets-mib "$3" --workloads "${WORKLOADS:-5x32768+1024}" --max-num-seqs "${SEQS:-8}" \
    --windows "${WINDOWS:-4,128}" --max-num-batched-tokens "${BATCHED:-163840}" --profile-dir /tmp/prof \
    --profile-delay 0 --profile-steps "${STEPS:-12}"
  python scripts/profile_summary.py /tmp/prof --each --json "$out/profile-summary.json"
  for f in /tmp/prof/"$2"/*.pt.trace.json.gz; do cp "$f" "$out/profile-$2.trace.json.gz"; done
  cp /tmp/prof/"$2"/profiler_out_0.txt "$out/profile-$2-kernels.txt";;
serve)
  d=$(python -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import serving_pressure as s; \
print(s.dummy_model_dir(Path('$out/serve')))")
  cp src/quantmla/assets/tiny-mla/tokenizer.json src/quantmla/assets/tiny-mla/tokenizer_config.json "$d/"
  printf '{"format": 1, "scheme": "c4r4", "method": "rtn", "group_size": 64, "sink": 4, "recent": 128}\n' \
    > "$d/quantmla.json"
  python -m vllm.entrypoints.cli.main serve "$d" --load-format dummy --block-size 64 --max-num-seqs 8 \
    --max-model-len 32768 --kv-cache-memory-bytes 2147483648 --port 8011 > "$out/serve.log" 2>&1 &
  pid=$!
  python - "$d" "$pid" <<'PY' || echo "the serve check failed: see $out/serve.log"
import json, os, sys, time, urllib.request
base = "http://localhost:8011"
for _ in range(600):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        os.kill(int(sys.argv[2]), 0)  # the server died: stop here
        time.sleep(1)
for prompt in ["The capital of France is", "Once upon a time"]:
    body = json.dumps({"model": sys.argv[1], "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    print(urllib.request.urlopen(req, timeout=120).read().decode())
PY
  kill "$pid" 2> /dev/null; wait "$pid" || true
  grep -i -E "quantmla|kv cache|maximum concurrency|error" "$out/serve.log" | head -30;;
*) sed -n '2,/^# Results go to/p' "$0"; exit 2;;
esac
cp "$out/serving.json" /tmp/serving.json 2>/dev/null || true
