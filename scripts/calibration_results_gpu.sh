#!/usr/bin/env bash
# QuantMLA's rows of docs/calibration-results.json on one GPU machine, in parallel processes:
# the layer stage one process per (scheme, layer), then the model stage and evaluation per
# (scheme, windows) and the content-path ablation. Parts already in $STAGES are not recomputed, so
# a run cut short resumes. The baselines come from:
#   python scripts/calibration_results.py --out out/p1 \
#       --runs bf16,rtn/c4r4,smoothquant/c4r4,quarot/c4r4,rtn/c2r4,smoothquant/c2r4,quarot/c2r4
# and the table from: python scripts/calibration_results.py --out out/calib --merge out/p1 $WORK/q/*
# usage: [EVAL_ARGS="--niah 1"] [SCHEMES="c4r4 c2r4"] [WINDOWS="with without" | none] [ABLATION=1] \
#   scripts/calibration_results_gpu.sh WORK_DIR [LAYER_STAGE_SECONDS]
set -u
WORK=${1:?usage: $0 WORK_DIR [LAYER_STAGE_SECONDS]}
LIMIT=${2:-400}
STAGES=$WORK/stages
export PYTHONPATH=${PYTHONPATH:-src} OMP_NUM_THREADS=1
SCHEMES=${SCHEMES:-c4r4 c2r4}
WINDOWS=${WINDOWS:-with without}
mkdir -p "$STAGES" "$WORK/logs"
layers=$(python -c "import quantmla; m, _ = quantmla.load(device='cpu'); print(m.config.num_hidden_layers)" 2>/dev/null)
t0=$(date +%s)
for s in $SCHEMES; do
  [ -f "$STAGES/$s-content+rope.pt" ] && continue
  for l in $(seq 0 $((layers - 1))); do
    [ -f "$STAGES/$s-content+rope.layers-$l.pt" ] && continue
    timeout "$LIMIT" python scripts/calibration_results.py --out "$WORK/ls/$s-$l" --runs "quantmla/$s" \
      --layer-stages "$STAGES" --layer-stage-only --stage-layers "$l" > "$WORK/logs/ls-$s-$l.log" 2>&1 &
  done
done
wait
echo "layer stages: $(($(date +%s) - t0)) s"
n=$(ls "$STAGES"/*.layers-*.pt 2>/dev/null | wc -l)
for s in $SCHEMES; do
  [ -f "$STAGES/$s-content+rope.pt" ] && continue
  want=$(($(echo $SCHEMES | wc -w) * layers))
  [ "$n" -ge "$want" ] || { echo "layer stage incomplete ($n of $want parts); run again"; exit 3; }
  # merged once here, before the parallel model-stage runs below (each would otherwise merge and save it)
  python -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from calibration_results import \
load_stage; load_stage(Path(sys.argv[1]))" "$STAGES/$s-content+rope.pt"
done
[ "$WINDOWS" = none ] && exit 0  # the layer stages only
t1=$(date +%s)
for s in $SCHEMES; do
  for w in $WINDOWS; do
    python scripts/calibration_results.py --out "$WORK/q/$s-$w" --runs "quantmla/$s" --layer-stages "$STAGES" \
      --windows "$w" ${EVAL_ARGS:-} > "$WORK/logs/q-$s-$w.log" 2>&1 &
  done
done
[ "${ABLATION:-1}" = 1 ] && python scripts/calibration_results.py --out "$WORK/q/ablation" \
  --runs quantmla/c4r4/content --layer-stages "$STAGES" --windows with ${EVAL_ARGS:-} > "$WORK/logs/q-ablation.log" 2>&1 &
wait
echo "model stages and evaluation: $(($(date +%s) - t1)) s"
grep -h '^{' "$WORK"/logs/q-*.log
