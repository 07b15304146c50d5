#!/usr/bin/env bash
# vLLM 0.33's wheels for the GPU machine (torch 2.14.0 with CUDA 13.0, triton 3.8.0), slimmed and packed into 13
# parts of 56 MiB (scripts/pack_wheels.sh; PART_MIB sets the size: 36 leaves room for a tree of ~26 MB).
#
#   bash scripts/vllm033_gpu_wheels.sh     downloads the new wheels into .wheels-src-033, takes the rest of the set
#                                          from .wheels-slim (scripts/vllm_gpu_wheels.sh: the 0.26 set, at versions
#                                          0.33 accepts), slims vllm and triton, splits everything into .wheels033
#                                          (git-ignored: .git/info/exclude)
#
# The wheels are the ones `from vllm import LLM` imports on sm_90 (module-level imports traced from vLLM's engine,
# workers, model runners, DeepSeek model and MLA backends); server-only packages (uvicorn, anthropic, mcp,
# opentelemetry), Mistral's tokenizer packages and SM100-only kernels are left out. The image's CUDA 13.0 libraries
# stand in for torch 2.14's nvidia-* pins. Left out of the vllm wheel (321 -> 170 MiB): FlashAttention-2 (FA3 runs
# on sm_90), the Rust frontend vllm-rs, the SM100 FMHA kernels; of the triton wheel (237 -> 152 MiB): CUPTI,
# ptxas-blackwell (sm_100 and up), the proton profiler and an instrumentation test library.
# The image's CUDA stack against torch 2.14's pins (read there, 2026-12-07): CUDA 13.0 runtime, cuBLAS, cuFFT, cuRAND,
# cuSOLVER, cuSPARSE, nvJitLink, NVTX and nvshmem match or are newer within 13.x; cuDNN is 9.19 (torch wants 9.24:
# serving_gpu.sh sets PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 for a TRIAL_VLLM run; vLLM's MLA path calls no cuDNN);
# NCCL is 2.28.9 (2.30.7 wanted), lacking 12 entry points libtorch_cuda.so imports (ncclCommResume, ncclCommGrow,
# ncclPutSignal, ...): torch does not import without them, so `serving_gpu.sh setup` preloads stubs of exactly those
# (a one-GPU engine calls none; tensor parallelism needs NCCL 2.30).
# Then, over one warm machine: one GPU run per part (scripts/pack_wheels.sh prints the plan), the last one running
# `TRIAL_VLLM=0.33 WHEELS=.wheels033 bash scripts/serving_gpu.sh setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${QUANTMLA_SHARED_TOOLS:-../shared/tools}
grep -q '^/\.wheels\*/\|^\.wheels\*/' .git/info/exclude 2>/dev/null || echo '.wheels*/' >> .git/info/exclude
new=(vllm==0.33.0 torch==2.14.0 triton==3.8.0 torchvision==0.29.0 flashinfer-python==0.7.2.post1
     apache-tvm-ffi==0.1.11 xgrammar==0.2.8 oss-harmony==0.0.11)
[ -f .wheels-src-033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl ] || bash "$tools/wheel-bundle" get .wheels-src-033 "${new[@]}"
reused=(annotated_types astor blake3 cachetools cbor2 compressed_tensors cuda_tile depyf dill distro fastapi ijson
        interegular jiter jsonschema jsonschema_specifications lark llguidance lm_format_enforcer loguru msgspec openai
        outlines_core partial_json_parser pybase64 pydantic pydantic_core python_json_logger pyzmq referencing rpds_py
        setproctitle sniffio starlette typing_inspection)
rm -rf .wheels-slim-033 && mkdir .wheels-slim-033
for name in "${reused[@]}"; do cp .wheels-slim/"$name"-[0-9]*.whl .wheels-slim-033/; done
slim() {  # SRC DST PATTERN...: the wheel without the matching entries, and without their lines in RECORD
  local src=$1 dst=$2; shift 2
  cp "$src" "$dst" && zip -q -d "$dst" "$@"
  local rec tmp; rec=$(unzip -Z1 "$dst" | grep '\.dist-info/RECORD$'); tmp=$(mktemp -d)
  mkdir -p "$tmp/$(dirname "$rec")"
  unzip -Z1 "$dst" > "$tmp/names"
  unzip -p "$dst" "$rec" | python3 -c '
import csv, sys
names = set(open(sys.argv[1]).read().split("\n"))
rows = [r for r in csv.reader(sys.stdin) if r and (r[0] in names or r[0].endswith("/RECORD"))]
csv.writer(sys.stdout, lineterminator="\n").writerows(rows)' "$tmp/names" > "$tmp/$rec"
  rm -f "$tmp/names"
  (cd "$tmp" && zip -q "$OLDPWD/$dst" "$rec"); rm -rf "$tmp"
}
for w in .wheels-src-033/*.whl; do
  case "$(basename "$w")" in
  vllm-*) slim "$w" ".wheels-slim-033/$(basename "$w")" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs' \
            'vllm/third_party/fmha_sm100/*' ;;
  triton-*) slim "$w" ".wheels-slim-033/$(basename "$w")" 'triton/backends/nvidia/lib/cupti/*' \
              'triton/backends/nvidia/lib/cupti-blackwell/*' 'triton/backends/nvidia/bin/ptxas-blackwell' \
              'triton/_C/libproton.so' 'triton/instrumentation/libGPUInstrumentationTestLib.so' ;;
  *) cp "$w" .wheels-slim-033/ ;;
  esac
done
bash scripts/pack_wheels.sh .wheels-slim-033 .wheels033 "${PART_MIB:-56}"
echo "then: TRIAL_VLLM=0.33 WHEELS=.wheels033 bash scripts/serving_gpu.sh setup"
