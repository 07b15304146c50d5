#!/usr/bin/env bash
# The bundled model on one GPU machine. Here, first:
#   python scripts/build_corpus.py --out .data/corpus-v2 --kernel --kernel-share 0.4 --package-bytes 700000
#   python scripts/train_tokenizer.py --corpus .data/corpus-v2 --out .data/tokenizer-v2 \
#       --tokenizer src/quantmla/assets/tiny-mla   # the shipped tokenizer (trained with --vocab 8192 --train-mb 40)
#   scripts/train_tiny_mla_gpu.sh pack      # .data/gpu: xz'd token arrays, tokenizer, NIAH haystack text (49 MB)
# then on the device (carry .data/gpu; the bundled model's shards removed from the working tree, so the tree
# and the carry fit in 64 MiB): scripts/train_tiny_mla_gpu.sh run
# It trains for BUDGET minutes (default 6.8) a model of FAMILY (mla: builtin:tiny-mla; gqa: the MLAfication teacher),
# evaluates the shipped BF16 weights on the whole validation and test splits and on NIAH through the model's own
# cache (training_log.json), runs quantmla's BF16 needle test (mla), and leaves in $OUT the two shards and rest.tar (config, tokenizer,
# training_log.json, loss_curve.png, niah/, ppl.txt). NIAH_SCHEMES (bf16) sets the needle test's caches; PPL_SECONDS
# (0: skipped) runs the README's perplexity (bundled test split at 4K, float32; PPL_SCHEMES, default bf16,c4r4).
#
# Detached, so that later calls can carry other work while it trains:
#   scripts/train_tiny_mla_gpu.sh launch    # (carry .data/gpu) copies the tree to $QM (/tmp/qm) and starts `run`
#                                           # there in its own session, its results in $RES (/tmp/res); then the
#                                           # command $AFTER, if given (e.g. the MLAfication benchmark on the teacher)
#   scripts/train_tiny_mla_gpu.sh collect   # waits for it (at most WAIT s), packs $RES into $OUT
# Two runs at once take their own QM, RES, WORK and TOK (the decompressed token splits).
#
# `scripts/train_tiny_mla_gpu.sh prepare` runs the four steps here (~5 minutes on 2 cores), each once.
#
# Fine-tuning (model v2 or the teacher trained on for retrieval): `pack-ft` writes .data/gpu-ft: the same files with
# every other chunk of 65,536 train tokens (so the carry fits beside the starting weights), model v2 (from the
# tree, or MLA_INIT) as v2/ and the teacher (TEACHER, default .data/teacher); on the device DATA=.data/gpu-ft and
# TRAIN_ARGS="--init .data/gpu-ft/v2 --keep last ...".
set -u
DATA=${DATA:-.data/gpu}
case "${1:-}" in
prepare)  # here, once: the corpus, its tokens, .data/gpu and .data/gpu-ft (each step skipped if its output exists)
  [ -f .data/corpus-v2/package/test.txt ] ||
    python scripts/build_corpus.py --out .data/corpus-v2 --kernel --kernel-share 0.4 --package-bytes 700000 || exit 1
  [ -f .data/tokenizer-v2/test.u16.npy ] ||
    python scripts/train_tokenizer.py --corpus .data/corpus-v2 --out .data/tokenizer-v2 \
      --tokenizer src/quantmla/assets/tiny-mla || exit 1
  [ -f .data/gpu/test.u16.npy.xz ] || bash "$0" pack || exit 1
  [ -f .data/gpu-ft/test.u16.npy.xz ] || bash "$0" pack-ft
  ;;
pack-ft)
  mkdir -p .data/gpu-ft/v2
  teacher=${TEACHER:-.data/teacher}
  python -c "
import lzma, numpy as np
a = np.load('.data/tokenizer-v2/train.u16.npy')
c = 65536
keep = np.concatenate([a[i:i + c] for i in range(0, len(a), c) if (i // c) % 2 == 0])
with lzma.open('.data/gpu-ft/train.u16.npy.xz', 'wb', preset=9) as f:
    np.save(f, keep)
print('train tokens kept:', len(keep), 'of', len(a))"
  cp .data/gpu/validation.u16.npy.xz .data/gpu/test.u16.npy.xz .data/gpu/tokenizer* .data/gpu/niah-text.txt .data/gpu-ft/
  cp "${MLA_INIT:-src/quantmla/assets/tiny-mla}"/{config.json,generation_config.json,model*.safetensors*,tokenizer*} .data/gpu-ft/v2/
  if [ -d "$teacher" ]; then
    mkdir -p .data/gpu-ft/teacher && cp "$teacher"/{config.json,generation_config.json,model.safetensors,tokenizer*} .data/gpu-ft/teacher/
  else
    echo "no teacher at $teacher: .data/gpu-ft holds model v2 alone"
  fi
  du -sh .data/gpu-ft
  ;;
pack)
  mkdir -p .data/gpu
  for s in train validation test; do xz -T2 -6 -c ".data/tokenizer-v2/$s.u16.npy" > ".data/gpu/$s.u16.npy.xz"; done
  cp .data/tokenizer-v2/tokenizer.json .data/tokenizer-v2/tokenizer_config.json .data/tokenizer-v2/tokenizer_stats.json .data/gpu/
  cp .data/corpus-v2/package/test.txt .data/gpu/niah-text.txt
  ;;
run)
  export PYTHONPATH=src
  T=${TOK:-/tmp/tok}; W=${WORK:-/tmp/train}; mkdir -p "$T" "$W"
  cp "$DATA"/tokenizer* "$T/" || exit 1
  python -c "
import lzma, shutil
for s in ('train', 'validation', 'test'):
    with lzma.open('$DATA/' + s + '.u16.npy.xz') as f, open('$T/' + s + '.u16.npy', 'wb') as g:
        shutil.copyfileobj(f, g, 1 << 24)"
  python scripts/train_tiny_mla.py --tokens "$T" --out "$W" --seq 4096 --batch 16 --retrieval-share 0.2 \
    --family "${FAMILY:-mla}" --niah-text "$DATA/niah-text.txt" \
    --budget-minutes "${BUDGET:-6.8}" --max-minutes "$(python -c "print(${BUDGET:-6.8} + 0.5)")" ${TRAIN_ARGS:-} 2>&1 | tee "$W/train.log"
  if [ "${FAMILY:-mla}" = mla ] && [ "${NIAH_SECONDS:-150}" != 0 ]; then timeout "${NIAH_SECONDS:-150}" python -m quantmla eval niah "$W/model" --scheme "${NIAH_SCHEMES:-bf16}" --device "${DEVICE:-cuda}" -n 2 ${NIAH_ARGS:-} \
    --text "$DATA/niah-text.txt" --out "$W/niah" 2>&1 | tail -20 || echo "niah: cut at ${NIAH_SECONDS:-150} s"; fi
  # the README's perplexity (bundled test split, every 4,096-token window), the shipped weights in float32
  if [ "${FAMILY:-mla}" = mla ] && [ "${PPL_SECONDS:-0}" != 0 ]; then timeout "${PPL_SECONDS}" python -m quantmla eval ppl "$W/model" --all --seq-len 4096 --scheme "${PPL_SCHEMES:-bf16,c4r4}" \
    --device "${DEVICE:-cuda}" --dtype float32 > "$W/ppl.txt" 2>&1 || echo "ppl: cut at ${PPL_SECONDS} s" >> "$W/ppl.txt"; head -12 "$W/ppl.txt"; fi
  mkdir -p "$W/niah" "$W/model"; touch "$W/loss_curve.png" "$W/training_log.json" "$W/ppl.txt"
  cp "$W"/model/model*.safetensors "$OUT/"
  tar -C "$W" -cf "$OUT/rest.tar" --exclude='*.safetensors' model training_log.json loss_curve.png train.log niah ppl.txt
  ;;
launch)
  Q=${QM:-/tmp/qm}; R=${RES:-/tmp/res}
  rm -rf "$Q" "$R" && mkdir -p "$Q" "$R"
  cp -r src scripts benchmarks pyproject.toml .data "$Q/" || exit 1
  cd "$Q" && OUT=$R setsid nohup bash -c "bash scripts/train_tiny_mla_gpu.sh run; ${AFTER:-true}; touch $R/DONE" \
    > "$R/pipeline.log" 2>&1 < /dev/null &
  sleep "${LAUNCH_WAIT:-45}"; cat "$R/pipeline.log"
  ;;
collect)
  R=${RES:-/tmp/res}
  for _ in $(seq "${WAIT:-500}"); do [ -f "$R/DONE" ] && break; sleep 1; done
  cat "$R/pipeline.log"
  cp "$R"/model*.safetensors "$OUT/" 2>/dev/null
  tar -C "$R" -czf "$OUT/res.tar.gz" --exclude='*.safetensors' .
  ls -la "$OUT"
  ;;
*) echo "usage: $0 prepare|pack|pack-ft|run|launch|collect (got: ${1:-nothing})" >&2; exit 2 ;;
esac
