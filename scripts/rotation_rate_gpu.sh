#!/usr/bin/env bash
# QuantMLA's rows of the calibration comparison on the bundled model again, with the model stage's width-scaled
# rotation rate (ModelLevelConfig.rotation_rate), on one GPU machine in one device call: C4R4 and C2R4, with and
# without the sink/recent windows, the content-only ablation, and at C2R4 with windows the rate swept (the old
# base rate, lr/16, lr/256) on the same layer stage; beside them QuaRot at C4R4 without windows (cut from the
# first run by its deadline); then, in the time left, the README's RTN perplexity table per scheme.
# Everything under $W is packed into $OUT/rate.tar.gz every 20 s and at the end.
# usage (on the device): scripts/rotation_rate_gpu.sh [DEADLINE_S] [NIAH_PER_CELL]; then here:
#   python scripts/calibration_results.py --out OUT --merge P1A P1B W/q/* W/quarot   (W/: the folders from
#   rate.tar.gz; P1A, P1B: the baselines' folders p1a and p1b of scripts/model_v2_calibration_gpu.sh's calib.tar.gz)
set -u
export PYTHONPATH=src
DEADLINE=${1:-540}
NIAH=${2:-2}
W=/tmp/rate; mkdir -p "$W/logs"
t0=$(date +%s)
left() { echo $((DEADLINE - 20 - $(date +%s) + t0)); }
pack() { tar -C "$W" --exclude='*.pt' -czf "$OUT/rate.tmp.tar.gz" . 2>/dev/null && mv "$OUT/rate.tmp.tar.gz" "$OUT/rate.tar.gz"; }
(while sleep 20; do pack; done) &
packer=$!
timeout "$(left)" python scripts/calibration_results.py --out "$W/quarot" --niah "$NIAH" --windows without \
  --runs quarot/c4r4 > "$W/logs/quarot.log" 2>&1 &
pq=$!
# the layer stages (one process per scheme and layer), then every model stage side by side
WINDOWS=none timeout "$(left)" bash scripts/calibration_results_gpu.sh "$W" 300 > "$W/logs/stages.log" 2>&1
echo "layer stages: rc $? at $(($(date +%s) - t0)) s"
sweep=()
for rate in 1e-3 6.25e-5 3.90625e-6; do  # the base rate (the defect), lr/16, lr/256; the default is lr/64
  timeout "$(left)" python scripts/calibration_results.py --out "$W/sweep/c2r4-$rate" --runs quantmla/c2r4 \
    --layer-stages "$W/stages" --windows with --model-rotation-lr "$rate" > "$W/logs/sweep-$rate.log" 2>&1 &
  sweep+=($!)
done
EVAL_ARGS="--niah $NIAH" timeout "$(left)" bash scripts/calibration_results_gpu.sh "$W" 300 > "$W/logs/quantmla.log" 2>&1
echo "quantmla: rc $? at $(($(date +%s) - t0)) s"
wait "$pq" "${sweep[@]}"  # not a bare wait: the packer loop never ends
echo "runs done at $(($(date +%s) - t0)) s"
pack
bash scripts/rtn_ppl_gpu.sh "$W" $((t0 + DEADLINE - 20))  # the README's perplexity table per scheme
kill $packer 2>/dev/null
pack
grep -h '^{' "$W"/logs/*.log | cut -c1-200
