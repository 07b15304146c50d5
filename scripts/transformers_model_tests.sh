#!/usr/bin/env bash
# transformers' own DeepSeek-V2/V3 model tests (not slow, integration classes deselected) with quantmla's latent
# attention and QuantizedLatentCache as the generation cache (the pytest plugin scripts/quantmla_hf_suite.py).
#
#   scripts/transformers_model_tests.sh TRANSFORMERS_CHECKOUT [pytest args...]
#
# TRANSFORMERS_CHECKOUT: a checkout of transformers at the tag of the installed version, e.g.
#   git clone --depth 1 -b v$(python -c 'import transformers; print(transformers.__version__)') \
#       https://github.com/huggingface/transformers
#   (or a tree assembled from the PyPI sdist's common tests and the nearest model and generation tests, as in
#   docs/notebook.md, 2026-12-07: test ids that fail there without the plugin too are version skew)
# Settings (environment): QUANTMLA_HF_SCHEME (c4r4), QUANTMLA_HF_SINK / QUANTMLA_HF_RECENT (4 / 128: the test
# sequences are shorter than the windows, so nothing is quantised; 0 / 0 quantises every token),
# QUANTMLA_HF_GROUP (auto). QUANTMLA_HF_BASELINE=1 runs the same selection without the plugin.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkout=${1:?usage: $0 TRANSFORMERS_CHECKOUT [pytest args...]}
shift
[ -d "$checkout/tests/models/deepseek_v2" ] || { echo "$0: no tests/models/deepseek_v2 under $checkout" >&2; exit 2; }
plugin=(-p quantmla_hf_suite)
[ "${QUANTMLA_HF_BASELINE:-0}" = 1 ] && plugin=()
cd "$checkout"
PYTHONPATH="$here:$here/../src${PYTHONPATH:+:$PYTHONPATH}" python -m pytest \
  "${plugin[@]}" -p no:cacheprovider -m "not slow" -k "not IntegrationTest" \
  tests/models/deepseek_v2 tests/models/deepseek_v3 -rfEs "$@"
