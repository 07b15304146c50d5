#!/usr/bin/env bash
# Issue 17's calibration comparison on the bundled model v2, on one GPU machine in one device call: RTN,
# SmoothQuant, QuaRot and QuantMLA at C4R4 and C2R4 (4,096-token test windows, with and without the sink/recent
# windows, KL, NIAH per method and scheme) and the README's perplexity table per scheme (model in bfloat16 and
# float32, with and without windows). Everything under $W is packed into $OUT/calib.tar.gz every 20 s and at
# the end, so a call cut short keeps what finished. usage (on the device): scripts/model_v2_calibration_gpu.sh
# [DEADLINE_S] [NIAH_PER_CELL]; then here: python scripts/calibration_results.py --out OUT --merge W/p1a W/p1b
# W/q/* (the folders unpacked from calib.tar.gz).
set -u
export PYTHONPATH=src
DEADLINE=${1:-560}
NIAH=${2:-2}
W=/tmp/cal2; mkdir -p "$W/logs"
t0=$(date +%s)
pack() { tar -C "$W" -czf "$OUT/calib.tmp.tar.gz" . 2>/dev/null && mv "$OUT/calib.tmp.tar.gz" "$OUT/calib.tar.gz"; }
(while sleep 20; do pack; done) &
packer=$!
# the baselines (each calibrates in seconds; the evaluation dominates), in two processes beside QuantMLA's
timeout $((DEADLINE - 30)) python scripts/calibration_results.py --out "$W/p1a" --niah "$NIAH" \
  --runs bf16,rtn/c4r4,smoothquant/c4r4,quarot/c4r4 > "$W/logs/p1a.log" 2>&1 &
pa=$!
timeout $((DEADLINE - 30)) python scripts/calibration_results.py --out "$W/p1b" --niah "$NIAH" \
  --runs rtn/c2r4,smoothquant/c2r4,quarot/c2r4 > "$W/logs/p1b.log" 2>&1 &
pb=$!
# QuantMLA: the layer stage one process per (scheme, layer), then the model stage and evaluation
EVAL_ARGS="--niah $NIAH" timeout $((DEADLINE - 30)) bash scripts/calibration_results_gpu.sh "$W" 300 \
  > "$W/logs/quantmla.log" 2>&1
echo "quantmla: rc $? at $(($(date +%s) - t0)) s"
wait "$pa" "$pb"
echo "baselines done at $(($(date +%s) - t0)) s"
pack
# the README's perplexity table per scheme on the whole test split at 4K windows (after the calibration, alone)
bash scripts/rtn_ppl_gpu.sh "$W" $((t0 + DEADLINE))
kill $packer 2>/dev/null
pack
grep -h '^{' "$W"/logs/*.log | cut -c1-200
