#!/usr/bin/env bash
# Model v3 and the MLAfication teacher with the same retrieval recipe, on one GPU machine, detached over a few
# calls (carry .data/gpu-ft from `scripts/train_tiny_mla_gpu.sh prepare`; the bundled shards moved out of the tree
# so that tree and carry fit in 64 MiB). Model v2's weights, the start, are in the history since the tree holds v3:
#   mkdir -p .data/v2 && cp src/quantmla/assets/tiny-mla/*.json .data/v2/ && for n in 1 2; do git show \
#     3cb178b:src/quantmla/assets/tiny-mla/model-0000$n-of-00002.safetensors > .data/v2/model-0000$n-of-00002.safetensors; done
#   rm -rf .data/gpu-ft && MLA_INIT=.data/v2 scripts/train_tiny_mla_gpu.sh prepare
#   scripts/retrieval_v3_gpu.sh launch    # starts the pipeline below, prints its first lines (launch-stage2: stage 2 only)
#   WAIT=S scripts/retrieval_v3_gpu.sh collect   # waits at most S s for it, packs what finished into $OUT
# The pipeline, one stage after the other on the GPU:
#   1. model v2's weights (.data/gpu-ft/v2) fine-tuned on the retrieval mix ($MIX) for BUDGET minutes (STEPS: that
#      many steps instead; model v3 is STEPS=4210), then its BF16/C4R4/C2R4
#      held-out NIAH and the README's perplexity (scripts/train_tiny_mla_gpu.sh run);
#   2. the teacher (--family gqa): trained from scratch for TEACHER_STEPS steps on the ordinary mix, then fine-tuned
#      on $MIX for TEACHER_FT_STEPS steps (fixed step counts: sharing the GPU changes their wall time, not their
#      training); with CAL=1, beside it, the README's calibration comparison on stage 1's weights
#      (scripts/model_v2_calibration_gpu.sh, held-out NIAH); with REL=1, after it, the seed papers' methods on the
#      same model (scripts/related_methods_gpu.sh part 8).
# TEACHER_FAMILY: gqa (5 layers, default) or gqa-deep (8 layers, the same 8 MB).
# START_SHARE: the share of retrieval rows with an asked needle at the haystack's first token (0 for model v3; the
# teacher found 3 of 18 needles at depth 0).
# collect packs $RES into $OUT every 20 s, so a call cut short still returns what finished.
set -u
MIX="--retrieval-share 0.55 --retrieval-generated 0.85 --retrieval-ask-all 0.5 --retrieval-copy 0.3 \
--retrieval-end ${END_SHARE:-0.2} --retrieval-short ${SHORT_SHARE:-0.3} --retrieval-start ${START_SHARE:-0} \
--retrieval-families memo=3,record=2,kv=2,delimited=2,statement=1,code=1,json=1,dialogue=1"
R=/tmp/res
case "${1:-}" in
launch)
  AFTER="bash scripts/retrieval_v3_gpu.sh stage2" DATA=.data/gpu-ft NIAH_SECONDS=240 NIAH_SCHEMES=bf16,c4r4,c2r4 \
    PPL_SECONDS=150 BUDGET=${BUDGET:-10} LAUNCH_WAIT=${LAUNCH_WAIT:-1} \
    TRAIN_ARGS="--init .data/gpu-ft/v2 --lr 8e-4 --keep last --warmup 50 $MIX${STEPS:+ --steps $STEPS --budget-minutes 0 --max-minutes 30}" \
    bash scripts/train_tiny_mla_gpu.sh launch
  ;;
launch-stage2)  # stage 2 alone (the teacher; CAL=1: and the calibration on the tree's bundled model, whose shards
  # then stay in the tree; .data/gpu-ft without v2/ keeps the carry small)
  rm -rf /tmp/qm "$R" && mkdir -p /tmp/qm "$R" && cp -r src scripts benchmarks pyproject.toml .data /tmp/qm/ || exit 1
  cd /tmp/qm && OUT=$R setsid nohup bash -c "bash scripts/retrieval_v3_gpu.sh stage2; touch $R/DONE" \
    > "$R/pipeline.log" 2>&1 < /dev/null &
  sleep 2; cat "$R/pipeline.log"
  ;;
stage2)  # in the copy of the tree (/tmp/qm), after stage 1, with OUT=/tmp/res
  mkdir -p "$R/teacher" "$R/cal"
  # the teacher (TEACHER=0: none): from scratch, then fine-tuned, in its own copy and work folders
  [ "${TEACHER:-1}" = 1 ] && (export QM=/tmp/qm2 RES=/tmp/res2 WORK=/tmp/train2 TOK=/tmp/tok2 FAMILY=${TEACHER_FAMILY:-gqa} DATA=.data/gpu-ft BUDGET=1 LAUNCH_WAIT=0
   TRAIN_ARGS="--budget-minutes 0 --max-minutes 30 --steps ${TEACHER_STEPS:-2900}" \
   AFTER="QM=/tmp/qm3 RES=$R/teacher WORK=/tmp/train3 TOK=/tmp/tok2 OUT=$R/teacher FAMILY=${TEACHER_FAMILY:-gqa} DATA=.data/gpu-ft BUDGET=1 \
     TRAIN_ARGS='--init /tmp/train2/model --lr 1e-3 --keep last --warmup 50 --budget-minutes 0 --max-minutes 30 \
     --steps ${TEACHER_FT_STEPS:-2000} $MIX' bash scripts/train_tiny_mla_gpu.sh run > $R/teacher/ft.log 2>&1" \
   bash scripts/train_tiny_mla_gpu.sh launch)
  if [ "${CAL:-0}" = 1 ]; then  # the calibration comparison on stage 1's weights (if it ran), as this copy's bundled model
    [ -d /tmp/train/model ] && cp /tmp/train/model/model*.safetensors /tmp/train/model/config.json src/quantmla/assets/tiny-mla/
    OUT=$R/cal bash scripts/model_v2_calibration_gpu.sh "${CAL_DEADLINE:-700}" 2 > "$R/cal/pipeline.log" 2>&1
  fi
  if [ "${REL:-0}" = 1 ]; then  # then the seed papers' methods on the same model (related_methods_gpu.sh part 8)
    mkdir -p "$R/rel" && OUT=$R/rel bash scripts/related_methods_gpu.sh "${REL_DEADLINE:-560}" 2 8 > "$R/rel/pipeline.log" 2>&1
  fi
  [ "${TEACHER:-1}" = 1 ] && for _ in $(seq 3000); do [ -f /tmp/res2/DONE ] && break; sleep 1; done
  true  # the stage succeeds with TEACHER=0 too (collect copies the teacher's pretraining log)
  ;;
collect)
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  pack() {
    cp "$R"/model*.safetensors "$OUT/" 2>/dev/null
    [ -f "$R/teacher/model.safetensors" ] && cp "$R/teacher/model.safetensors" "$OUT/teacher.safetensors"
    cp /tmp/res2/pipeline.log "$R/teacher/pretrain.log" 2>/dev/null
    tar -C "$R" -czf "$OUT/res.tmp.tar.gz" --exclude='*.safetensors' --exclude='calib.tmp.tar.gz' . &&
      mv "$OUT/res.tmp.tar.gz" "$OUT/res.tar.gz"
  }
  t0=$(date +%s)
  while [ ! -f "$R/DONE" ] && [ $(($(date +%s) - t0)) -lt "${WAIT:-500}" ]; do pack; sleep 20; done
  pack
  tail -n 5 "$R/pipeline.log" "$R"/cal/pipeline.log "$R"/rel/pipeline.log /tmp/res2/pipeline.log "$R"/teacher/ft.log 2>/dev/null
  ls -la "$OUT"
  ;;
*) echo "usage: $0 launch|launch-stage2|collect (got: ${1:-nothing})" >&2; exit 2 ;;
esac
