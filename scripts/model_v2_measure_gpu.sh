#!/usr/bin/env bash
# The README's accuracy figures on the bundled model v2, on one GPU machine in one device call (issue 17):
# NIAH per scheme (with and without the sink/recent windows) and perplexity per scheme at 4K windows (model in
# bfloat16, then float32), each step under its own time limit and its result copied to $OUT as soon as it is
# there, so a call cut short keeps what finished. usage (on the device): scripts/model_v2_measure_gpu.sh [DEADLINE_S]
set -u
export PYTHONPATH=src
DEADLINE=${1:-420}
W=/tmp/m2; mkdir -p "$W"
t0=$(date +%s)
left() { echo $((DEADLINE - ($(date +%s) - t0))); }
step() {  # step NAME SECONDS COMMAND...: run with a limit, then pack everything so far into $OUT
  local name=$1 limit=$2; shift 2
  [ "$(left)" -gt 20 ] || { echo "$name: skipped (deadline)"; return; }
  [ "$limit" -lt "$(left)" ] || limit=$(left)
  timeout "$limit" "$@" > "$W/$name.out" 2> "$W/$name.log"; echo "$name: rc $? at $(($(date +%s) - t0)) s"
  tar -C "$W" -czf "$OUT/m2.tar.gz" .
}
T=niah-1,niah-2,niah-3,niah-mk
step niah-with 160 python -m quantmla eval niah --scheme bf16,fp8,c8r8,c4r4,c2r4 --tasks $T -n 2 --device cuda \
  --out "$W/niah-with" --json
step niah-none 80 python -m quantmla eval niah --scheme c4r4,c2r4 --tasks $T -n 2 --sink 0 --recent 0 \
  --device cuda --out "$W/niah-none" --json
for dt in bfloat16 float32; do
  for w in with none; do
    step "ppl-$dt-$w" 90 python -m quantmla eval ppl --all --device cuda --dtype $dt --seq-len 4096 \
      --scheme bf16,fp8,c8r8,c4r4,c2r4 $([ $w = none ] && echo --no-sink-recent) --json
  done
done
grep -h "quantmla cache" "$W"/*.log | sort | uniq -c | head
