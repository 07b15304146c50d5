#!/usr/bin/env bash
# vLLM 0.33's wheels for the GPU machine (torch 2.14.0 with CUDA 13.0, triton 3.8.0), slimmed and packed into 13 parts of 56 MiB.
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
# NCCL is 2.28.9 (2.30.7 wanted), lacking 11 symbols libtorch_cuda.so imports (ncclCommGrow, ncclCommSuspend,
# ncclPutSignal, ...), which torch binds lazily and a one-GPU engine never calls.
# Then, over one warm machine: one GPU run per part (the plan wheel-bundle prints), the last one running
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
# Packed here rather than by wheel-bundle: each wheel rewritten with its members stored (the same names, bytes and
# attributes, so RECORD holds and pip installs it unchanged), then the whole set xz-compressed across wheels
# (939 -> 678 MiB: 13 parts of 56 MiB instead of 18 of 54, five fewer GPU calls; the tree carried beside a part is 7 MiB)
rm -rf .wheels-stored-033 && mkdir .wheels-stored-033
python3 - <<'PY'
import copy, pathlib, shutil, zipfile
for wheel in sorted(pathlib.Path(".wheels-slim-033").glob("*.whl")):
    out = pathlib.Path(".wheels-stored-033") / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            stored = copy.copy(info)
            stored.compress_type = zipfile.ZIP_STORED
            with src.open(info) as f, dst.open(stored, "w") as g:
                shutil.copyfileobj(f, g, 1 << 24)
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(out) as b:  # the same members, contents and modes
        same = [(i.filename, i.CRC, i.file_size, i.external_attr) for i in a.infolist()]
        assert same == [(i.filename, i.CRC, i.file_size, i.external_attr) for i in b.infolist()], wheel
        assert b.testzip() is None, wheel
PY
rm -rf .wheels033 && mkdir .wheels033
tar -C .wheels-stored-033 -cf - $(cd .wheels-stored-033 && ls ./*.whl) | xz -T2 -6 | split -b 56M -d -a 2 - .wheels033/part.
(cd .wheels033 && sha256sum part.* > SHA256SUMS)
cat > .wheels033/install.sh <<'SH'
#!/usr/bin/env bash
# Checks the parts (carried earlier into /tmp/wheel-parts, or next to this file), joins and unpacks them, and installs
# the wheels into ${TARGET:-/tmp/site} (no index, no dependencies).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); target=${TARGET:-/tmp/site}; parts=/tmp/wheel-parts
mkdir -p "$parts"; cp "$here"/part.* "$parts"/ 2>/dev/null || true; cp "$here/SHA256SUMS" "$parts/"
missing=$(cd "$parts" && awk '{print $2}' SHA256SUMS | while read -r f; do [ -f "$f" ] || echo "$f"; done)
[ -z "$missing" ] || { echo "install.sh: parts not on this machine (carry them first):" $missing; exit 1; }
(cd "$parts" && sha256sum --quiet -c SHA256SUMS) || { echo "install.sh: a part is corrupt: carry it again"; exit 1; }
rm -rf /tmp/wheel-bundle && mkdir -p /tmp/wheel-bundle "$target"
unxz() { if command -v xz >/dev/null; then xz -d -T0; else python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)'; fi; }
(cd "$parts" && cat $(awk '{print $2}' SHA256SUMS)) | unxz | tar -xf - -C /tmp/wheel-bundle
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" /tmp/wheel-bundle/*.whl
echo "installed $(ls /tmp/wheel-bundle/*.whl | wc -l) wheels into $target"
SH
chmod +x .wheels033/install.sh
n=$(ls .wheels033/part.* | wc -l)
echo "$n parts in .wheels033. Over one warm machine: calls 1..$((n - 1)) carry [\".wheels033/part.NN\"] and run"
echo "  mkdir -p /tmp/wheel-parts && cp .wheels033/part.* /tmp/wheel-parts/"
echo "the last carries [\".wheels033/part.$(printf %02d $((n - 1)))\", \".wheels033/install.sh\", \".wheels033/SHA256SUMS\"] and runs"
echo "  TRIAL_VLLM=0.33 WHEELS=.wheels033 bash scripts/serving_gpu.sh setup"
