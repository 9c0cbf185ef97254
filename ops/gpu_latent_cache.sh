#!/usr/bin/env bash
# The fp8 DSA latent cache and long contexts on a CUDA machine, in parts that each fit a 10-minute call (from the
# repository root):
#   bash ops/gpu_latent_cache.sh OUT_DIR tests|dsa|accuracy|context|whole
# tests: the kernels over an fp8 cache against the torch path, the engine over it against a cache rounding
#        through e4m3 (float32, graphs) and its bf16 loss (tests/gpu/test_dsa_kernels.py,
#        tests/gpu/test_fp8_latent_cache_cuda.py);
# dsa: one DSA layer's selection and attention, bf16 and fp8 caches, decode up to 128k context (ops/bench_dsa.py);
# accuracy: fp8 against bf16 logits and greedy runs over 2,048 generated tokens on a 4-layer release-shape slice;
# context: batch-1 decode at 1k, 32k and 128k context on the 8-layer slice, both caches;
# whole: the same at 1k and 128k for the whole model (45 layers) under hybrid offload, fp8 cache.
# PART_TIMEOUT (seconds, default 560) bounds the part. Wheels the machine lacks: see ops/gpu_env.sh.
set -uo pipefail
out=${1:?output directory}; part=${2:?tests, dsa, accuracy, context or whole}
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1  # kept in the output folder even when a caller's time limit cuts the run
source ops/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
limit=${PART_TIMEOUT:-560}
case "$part" in
  tests) timeout "$limit" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_dsa_kernels.py \
           tests/gpu/test_fp8_latent_cache_cuda.py > "$out/latent_tests.log" 2>&1; tail -30 "$out/latent_tests.log" ;;
  dsa) timeout "$limit" python3 -m ops.bench_dsa --json "$out/dsa.json" ;;
  accuracy) timeout "$limit" python3 -m ops.bench_latent_cache accuracy --layers 4 --tokens 2048 \
              --json "$out/latent_accuracy.json" ;;
  context) timeout "$limit" python3 -m ops.bench_latent_cache context --layers 8 --contexts 1024,32768,131072 \
             --tokens 64 --json "$out/latent_context.json" ;;
  whole) python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
         timeout "$limit" python3 -m ops.bench_latent_cache context --layers 45 --expert-slots auto \
           --contexts 1024,131072 --caches fp8 --tokens 32 --json "$out/latent_whole.json" ;;
  *) echo "unknown part: $part"; exit 2 ;;
esac
