#!/usr/bin/env bash
# The README's perplexity table per scheme (RTN, the untouched bundled model) on the whole test split at 4K windows,
# in bfloat16 and float32, with and without the sink/recent windows: four runs, each skipped when fewer than 30 s are
# left before END (epoch seconds). Called by scripts/model_v2_calibration_gpu.sh and scripts/rotation_rate_gpu.sh.
# usage (on the device): scripts/rtn_ppl_gpu.sh OUT_DIR END_EPOCH_S   (writes OUT_DIR/ppl-DTYPE-with|none.json)
set -u
W=${1:?usage: $0 OUT_DIR END_EPOCH_S}
END=${2:?usage: $0 OUT_DIR END_EPOCH_S}
mkdir -p "$W/logs"
for dt in bfloat16 float32; do
  for w in with none; do
    left=$((END - $(date +%s)))
    [ "$left" -gt 30 ] || { echo "ppl-$dt-$w: skipped (deadline)"; continue; }
    timeout "$left" python -m quantmla eval ppl --all --device cuda --dtype $dt --seq-len 4096 \
      --scheme bf16,fp8,c8r8,c4r4,c2r4 $([ $w = none ] && echo --no-sink-recent) --json \
      > "$W/ppl-$dt-$w.json" 2> "$W/logs/ppl-$dt-$w.log"
    echo "ppl-$dt-$w: rc $? with $((END - $(date +%s))) s left"
  done
done
