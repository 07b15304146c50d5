#!/usr/bin/env bash
# benchmarks/v3_layerwise.py on one GPU machine, detached so that it can outlast one call:
#   scripts/v3_layerwise_gpu.sh launch    # copies the tree to /tmp/v3run and starts the runs there
#   scripts/v3_layerwise_gpu.sh collect   # waits for them (at most WAIT s), copies logs and JSON into $OUT
# The runs, one after the other:
#   1. all 61 layers of DeepSeek-V3's shape (3 dense + 58 MoE) at V3's attention width, QuantMLA's layer stage end
#      to end (routed experts shrunk to 4 a layer so that the checkpoint fits the machine's disk: ~29 GB of FP8);
#   2. V3's 256 routed experts (1 dense + 1 MoE layer), rtn, QuantMLA and raq (one MoE layer is 11 GB of FP8).
set -u
R=/tmp/v3run
case "${1:-}" in
launch)
  rm -rf "$R" && mkdir -p "$R" && cp -r src benchmarks "$R/" || exit 1
  cd "$R" && PYTHONPATH=src PYTHONUNBUFFERED=1 setsid nohup bash -c "
    python benchmarks/v3_layerwise.py --dir /tmp/v3-61 --layers 61 --dense 3 --experts 4 --methods quantmla \
      --max-seconds 1e9 --json $R/v3-61-layers.json > $R/v3-61-layers.log 2>&1
    rm -rf /tmp/v3-61*
    python benchmarks/v3_layerwise.py --dir /tmp/v3e256 --layers 2 --dense 1 --experts 256 --methods rtn,quantmla,raq \
      --max-seconds 1e9 --json $R/v3-256-experts.json > $R/v3-256-experts.log 2>&1
    touch $R/DONE" > "$R/pipeline.log" 2>&1 < /dev/null &
  ;;
collect)
  for _ in $(seq "${WAIT:-500}"); do [ -f "$R/DONE" ] && break; sleep 1; done
  cp "$R"/*.json "$R"/*.log "$OUT/" 2>/dev/null
  nvidia-smi --query-gpu=name --format=csv,noheader
  tail -n 8 "$R"/*.log
  ;;
*)
  echo "usage: $0 launch|collect" >&2
  exit 2
  ;;
esac
