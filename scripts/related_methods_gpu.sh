#!/usr/bin/env bash
# Issue 18's comparison on the bundled model v2, on one GPU machine in one device call: the seed papers' methods
# (RAQ-MLA, Block-GTQ, RoLaQ) and the baselines at the three budgets (~4.5, ~2.9 and ~2.65 bits per element at
# the model's 256 + 64), 4,096-token test windows with the sink/recent windows, KL, NIAH, per-window NLL for the paired bootstrap. The rows of
# RTN/SmoothQuant/QuaRot/QuantMLA at C4R4 and C2R4 come from scripts/model_v2_calibration_gpu.sh (same protocol).
# Everything under $W is packed into $OUT/related.tar.gz every 20 s and at the end.
# usage (on the device): scripts/related_methods_gpu.sh [DEADLINE_S] [NIAH_PER_CELL] [PART]
# PART 1 (default): RAQ-MLA, Block-GTQ, baselines and QuantMLA at 2.47 BPE; PART 2: RoLaQ (150 steps) and
# quantmla-raq (50 layer-stage steps), shortened to fit the session's device time; PART 3: quantmla-raq on saved
# QuantMLA layer stages and RAQ-MLA fitted at 4,096 tokens, the calibration cost at DeepSeek-V2-Lite's shape;
# PART 4: the combined method at the three budgets (RAQ-MLA's schemes) and token protection off, detached, over
# two calls: DEADLINE covers both (e.g. 1000), the second call is `scripts/related_methods_gpu.sh 0 0 collect`;
# PART 5: the combined method below 3 bits on part 4's saved layer stages, in one call (ROLAQ300=1: and RoLaQ
# at 300 steps beside it); PART 6: the combined method at RAQ-MLA's INT4 scheme without clipping (c4g128r4p128,
# 4.25 BPE), its layer stage computed here, and RTN at that scheme, in one call; PART 7: raq-alloc, RAQ-MLA's
# transforms with bits allocated across layers, beside RAQ-MLA at one scheme, in one call (below); PART 8: the
# table of the seed papers' methods re-measured on the bundled model in one call (RAQ-MLA and raq-alloc at the
# three budgets, Block-GTQ at ~4.5 BPE, RoLaQ at ~2.9 BPE; QuantMLA's rows come from the calibration comparison);
# PART 9: the combined method (quantmla-raq) at the three budgets, its layer stages computed here, in one call.
set -u
export PYTHONPATH=src
DEADLINE=${1:-560}
NIAH=${2:-2}
PART=${3:-1}
W=/tmp/rel$PART; mkdir -p "$W/logs"
t0=$(date +%s)
pack() {  # the saved layer stages travel as their own files (parts 4 and 5), not in the archive
  tar -C "$W" --exclude='*.pt' --exclude=./code -czf "$OUT/related.tmp.tar.gz" . 2>/dev/null &&
    mv "$OUT/related.tmp.tar.gz" "$OUT/related.tar.gz"
}
packer=
case $PART in 1|2|3|5|7|8|9) (while sleep 20; do pack; done) & packer=$! ;; esac
run() {  # name, comma list of METHOD/SCHEME runs, extra arguments
  timeout $((DEADLINE - 30 - $(date +%s) + t0)) python scripts/calibration_results.py --out "$W/$1" --niah "$NIAH" --windows with \
    --runs "$2" ${3:-} > "$W/logs/$1.log" 2>&1 &
  jobs_+=($!)
}
jobs_=()
finish() { wait "${jobs_[@]}"; }  # the runs only: a bare wait would also wait for the packer loop
end_part() {  # parts 2 and 3: wait, pack, print the result lines
  finish
  echo "part $PART done at $(($(date +%s) - t0)) s"
  [ -n "$packer" ] && kill $packer 2>/dev/null
  pack
  grep -h '^{' "$W"/logs/*.log | cut -c1-220
  exit 0
}
NEW_SCHEMES="c2q94r4p64 c2g128q94r4p128"  # RAQ-MLA's own schemes at ~2.9 and ~2.65 BPE
collect() {  # PART 4's foreground: wait for the detached runs (or $1 seconds), pack, return the new layer stages
  while [ ! -f "$W/done" ] && [ $(($(date +%s) - t0)) -lt "$1" ]; do sleep 5; done
  pack
  for s in $NEW_SCHEMES; do  # '+' is not a name the device returns: renamed, back to $s-content+rope.pt here
    f="$W/quantmla/stages/$s-content+rope.pt"; [ -f "$f" ] && cp "$f" "$OUT/$s.stage.pt"
  done
  tail -n 3 "$W"/detached*.log 2>/dev/null
  grep -h '^{' "$W"/logs/*.log 2>/dev/null | cut -c1-220
  exit 0
}
alloc_pair() {  # scheme, name suffix: raq-alloc and RAQ-MLA side by side, with the caller's $R
  run "alloc${2:-}" "raq-alloc/$1" "$R"
  run "raq4k${2:-}" "raq/$1" "$R"
}
layer_stages() {  # schemes, timeout, per-process limit (s): QuantMLA's layer stages into $Q/stages, one process a layer
  Q=$W/quantmla; mkdir -p "$Q/stages"
  SCHEMES="$1" WINDOWS=none ABLATION=0 timeout "$2" \
    bash scripts/calibration_results_gpu.sh "$Q" "$3" > "$W/logs/stages.log" 2>&1
  echo "layer stages: rc $? at $(($(date +%s) - t0)) s"
}
if [ "$PART" = collect ]; then W=/tmp/rel${COLLECT_PART:-4}; collect "${COLLECT_S:-560}"; fi
if [ "$PART" = 8 ]; then
  # eight processes side by side, two threads each (the machine has 16 cores): part 7's pair at the three budgets,
  # Block-GTQ and RoLaQ
  export OMP_NUM_THREADS=2
  R="--rope-fit-seq-len 4096"
  alloc_pair c4r4 -45; alloc_pair c2q94r4p64 -27; alloc_pair c2g128q94r4p128 -25
  run gtq-45 blockgtq/c4r4t
  run rolaq-27 rolaq/c2r4 "--steps 150"
  end_part
fi
if [ "$PART" = 9 ]; then
  # QuantMLA's layer stages at the three budgets' schemes (one process per scheme and layer), then the combined
  # method on them side by side, as part 4 ran it (RAQ-MLA's post-RoPE fits at 4,096-token windows)
  # ($COMB_SCHEMES: a subset of c4r4 and $NEW_SCHEMES)
  schemes=${COMB_SCHEMES:-c4r4 $NEW_SCHEMES}
  layer_stages "$schemes" 260 250
  for s in $schemes; do
    run "comb-$s" "quantmla-raq/$s" "--rope-fit-seq-len 4096 --layer-stages $Q/stages"
  done
  end_part
fi
if [ "$PART" = 7 ]; then
  # raq-alloc (RAQ-MLA's transforms, each layer's formats allocated by held-out KL within the scheme's bits) and
  # RAQ-MLA, both with the post-RoPE fit at 4,096-token windows, side by side at one scheme ($SCHEME7:
  # c2q94r4p64, c2g128q94r4p128 or c4r4; WINDOWS7=without: token protection off) in one call: ~260 s for
  # c2q94r4p64 on 2026-12-04. (Six such runs side by side, detached over two calls, lost their results twice: the
  # device time ran out before their evaluations ended, then the machine was released between the calls.)
  R="--rope-fit-seq-len 4096 --windows ${WINDOWS7:-with}"
  alloc_pair "${SCHEME7:-c2q94r4p64}"
  end_part
fi
if [ "$PART" = 4 ] && [ -z "${DETACHED:-}" ]; then
  # the runs outlive this call (a new process session): a second call on the warm machine, made at once,
  # collects them with PART=collect
  DETACHED=1 setsid nohup bash "$0" "$@" > "$W/detached.log" 2>&1 < /dev/null &
  collect "${COLLECT_S:-560}"
fi
if [ "$PART" = 4 ]; then
  # the combined method (RAQ-MLA's fits from both bases, its post-RoPE fits at 4,096-token windows, QuantMLA's
  # model stage as QuantMLA's rows run it: 150 steps at 512) at the three budgets, on RAQ-MLA's own schemes
  # below 3 bits: c4r4 on its saved layer stage (carried in $STAGES), the new schemes' layer stages computed
  # here (one process per layer); token protection off (no sink, no recent window): RTN and RoLaQ (150 steps)
  R="--rope-fit-seq-len 4096"
  run comb-45 quantmla-raq/c4r4 "$R --layer-stages ${STAGES:-out/stages-v2}"
  nw="--windows without"
  run nw-rtn rtn/c2r4,rtn/c2g128r4 "$nw"
  run nw-rolaq-27 rolaq/c2r4 "$nw --steps 150"
  run nw-rolaq-25 rolaq/c2g128r4 "$nw --steps 150"
  layer_stages "$NEW_SCHEMES" 400 300
  run comb-27 quantmla-raq/c2q94r4p64 "$R --layer-stages $Q/stages"
  run comb-25 quantmla-raq/c2g128q94r4p128 "$R --layer-stages $Q/stages"
  finish
  echo "part 4 done at $(($(date +%s) - t0)) s"
  touch "$W/done"
  exit 0
fi
if [ "$PART" = 5 ]; then
  # the combined method below 3 bits on the layer stages part 4 computed (carried in $STAGES, e.g.
  # out/stages-new: c2q94r4p64 and c2g128q94r4p128), as part 4 runs it; one call of about ten minutes
  R="--rope-fit-seq-len 4096 --layer-stages ${STAGES:-out/stages-new}"
  run comb-27 quantmla-raq/c2q94r4p64 "$R"
  run comb-25 quantmla-raq/c2g128q94r4p128 "$R"
  if [ "${ROLAQ300:-0}" = 1 ]; then  # RoLaQ at 300 steps, as QuantMLA's layer stage (part 2 ran 150)
    run rolaq300-27 rolaq/c2r4 "--steps 300"
    run rolaq300-25 rolaq/c2g128r4 "--steps 300"
  fi
  end_part
fi
if [ "$PART" = 6 ]; then
  S=c4g128r4p128
  run rtn-45b rtn/$S
  layer_stages "$S" "${STAGE_S:-300}" "${STAGE_S:-300}"
  run comb-45b quantmla-raq/$S "--rope-fit-seq-len 4096 --layer-stages $Q/stages"
  end_part
fi
if [ "$PART" = 3 ]; then
  # the combined method on QuantMLA's saved layer stages (carried in $STAGES: c4r4, c2r4, c2g128q94r4t, 300
  # steps), its model stage and RAQ-MLA's fits on 4,096-token windows; RAQ-MLA alone with its post-RoPE
  # transform fitted at the served context (and at INT4 without clipping); the calibration cost at
  # DeepSeek-V2-Lite's attention shape (env: MODEL_STEPS, RAQ45=0 and COST=0 leave those runs out)
  STAGES=${STAGES:-out/stages-v2}
  L="--model-seq-len 4096"
  M="--model-steps ${MODEL_STEPS:-150}"  # QuantMLA's model stage inside quantmla-raq
  run comb-45 quantmla-raq/c4r4 "$L $M --layer-stages $STAGES"
  run comb-27 quantmla-raq/c2r4 "$L $M --layer-stages $STAGES"
  run comb-25 quantmla-raq/c2g128q94r4t "$L $M --layer-stages $STAGES"
  [ "${RAQ45:-1}" = 1 ] && run raq4k-45 raq/c4r4,raq/c4g128q94r4p128 "$L"
  run raq4k-27 raq/c2q94r4p64 "$L"
  run raq4k-25 raq/c2g128q94r4p128 "$L"
  if [ "${COST:-1}" = 1 ]; then
    timeout $((DEADLINE - 30)) python benchmarks/calibration_cost.py --device cuda --shape v2-lite \
      --json "$W/cost-v2-lite.json" > "$W/logs/cost.log" 2>&1 &
    jobs_+=($!)
  fi
  end_part
fi
if [ "$PART" = 2 ]; then
  run rolaq-27 rolaq/c2r4 "--steps 150"
  run rolaq-25 rolaq/c2g128r4,rtn/c2g128r4 "--steps 150"
  # the combined method: QuantMLA's stages (50 layer steps here, for time) then RAQ-MLA on the fused model
  run comb-45 quantmla-raq/c4r4 "--steps 50"
  run comb-27 quantmla-raq/c2q94r4t,rtn/c2q94r4t "--steps 50"
  run comb-25 quantmla-raq/c2g128q94r4t "--steps 50"
  end_part
fi
run raq-45 raq/c4g128q94r4p128,rtn/c4g128q94r4p128
run raq-27 raq/c2q94r4p64,rtn/c2q94r4p64
run raq-25 raq/c2g128q94r4p128,rtn/c2g128q94r4p128
run gtq-45 blockgtq/c4r4t,rtn/c4r4t
run gtq-27 blockgtq/c2r4t,rtn/c2r4t
run gtq-25 blockgtq/c2g128q94r4t,rtn/c2g128q94r4t
run base-25 smoothquant/c2g128q94r4t,quarot/c2g128q94r4t
# QuantMLA at the ~2.5 budget: the layer stage one process per layer, then the model stage and evaluation
SCHEMES=c2g128q94r4t WINDOWS=with ABLATION=0 EVAL_ARGS="--niah $NIAH" timeout $((DEADLINE - 30)) \
  bash scripts/calibration_results_gpu.sh "$W/quantmla" 300 > "$W/logs/quantmla.log" 2>&1
echo "quantmla: rc $? at $(($(date +%s) - t0)) s"
finish
echo "all done at $(($(date +%s) - t0)) s"
kill $packer 2>/dev/null
pack
grep -h '^{' "$W"/logs/*.log "$W"/quantmla/logs/*.log 2>/dev/null | cut -c1-220
