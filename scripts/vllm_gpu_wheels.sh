#!/usr/bin/env bash
# vLLM 0.26's wheels for the H200 runs of scripts/serving_gpu.sh, slimmed and packed into 3 parts of 56 MiB
# (scripts/pack_wheels.sh; 6 parts of 40 MiB before).
# A call carries 64 MiB with the tree: with the bundled model's shards in the tree (~26 MB) 56 MiB parts need the
# shards moved out for the upload calls; PART_MIB=36 gives 4 parts that travel with the whole tree.
#
#   bash scripts/vllm_gpu_wheels.sh        downloads ../shared/tools/vllm-gpu-wheels.txt into .wheels-src, repacks
#                                          the vllm wheel without what a DeepSeek-V2 run on sm_90 never loads,
#                                          and splits everything into .wheels (git-ignored: .git/info/exclude)
#
# Left out of the vllm wheel (303 MB -> 151 MB): the FlashAttention-2 library (vLLM runs FA3 on sm_90 and
# imports FA2 only if present), the Rust frontend binary vllm-rs (used only when VLLM_RUST_FRONTEND_PATH
# asks for it), DeepGEMM's extension for Pythons other than 3.12, and the SM100 FMHA headers.
# Then, over one warm machine: one GPU run per part (scripts/pack_wheels.sh prints the plan), the last one running
# `bash scripts/serving_gpu.sh setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${QUANTMLA_SHARED_TOOLS:-../shared/tools}
grep -q '^/\.wheels\*/\|^\.wheels\*/' .git/info/exclude 2>/dev/null || echo '.wheels*/' >> .git/info/exclude
[ -f .wheels-src/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl ] || \
  bash "$tools/wheel-bundle" get .wheels-src $(grep -v '^#' "$tools/vllm-gpu-wheels.txt")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && unzip -q "$OLDPWD/.wheels-src/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" \
  && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/_C.cpython-31[01345]*.so \
  && rm -rf vllm/third_party/fmha_sm100 && zip -q -r -9 ../vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl .)
rm -rf .wheels-slim && mkdir .wheels-slim
cp .wheels-src/*.whl .wheels-slim/
mv "$work/../vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl" .wheels-slim/
bash scripts/pack_wheels.sh .wheels-slim .wheels "${PART_MIB:-56}"
