#!/usr/bin/env bash
# GPU correctness and kernel timings in one go (CUDA machine, from the repository root):
#   bash ops/gpu_checks.sh OUT_DIR [pytest args...]
# Wheels the machine lacks: see ops/gpu_env.sh.
set -uo pipefail
out=${1:?output directory}; shift
mkdir -p "$out"
source ops/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
python3 -m pytest -q tests/gpu --timeout 300 "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -25
for bench in bench_experts bench_kda bench_mhc bench_fp8; do
  echo "== $bench"
  python3 -m "ops.$bench" --json "$out/$bench.json" 2>&1 | tee "$out/$bench.log" | tail -30
done
