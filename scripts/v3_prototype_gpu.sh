#!/usr/bin/env bash
# Issue 19 on the H200 in one device call: the Hopper extension's JIT build, the fragment probe and the h = 16
# prototype against float64 (tests/kernels/test_hopper_probe.py), then the prototype's timing
# (benchmarks/experiments/v3_tile_h16.py) and ptxas' resource report.
# usage (on the device): bash scripts/v3_prototype_gpu.sh
set -u
export PYTHONPATH=src
nvcc -gencode arch=compute_90a,code=sm_90a -cubin -O3 -std=c++17 -Xptxas -v -o /tmp/tile.cubin \
  src/quantmla/kernels/hopper/tile_h16.cu 2>&1 | grep -E "registers|spill|stack"
python -m pytest -q -x tests/kernels/test_hopper_probe.py tests/kernels/test_fragment.py -rs 2>&1 | tail -15
python benchmarks/experiments/v3_tile_h16.py
