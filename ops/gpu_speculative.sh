#!/usr/bin/env bash
# Speculative decoding on a CUDA machine, in parts that each fit a 10-minute call (from the repository root):
#   bash ops/gpu_speculative.sh OUT_DIR tests|bench|whole
# tests: the MTP layer, verified greedy output and the verify graphs in bf16 on CUDA
#        (tests/gpu/test_speculative_cuda.py, tests/gpu/test_decode_graphs.py), and the FP8-block linear of the MTP
#        layer's shapes where a split K overshoots (tests/gpu/test_fp8_kernels.py);
# bench: the cost table: decode against drafting and k = 1, 2, 3 verify steps on the resident 8-layer slice at
#        batch 1 and 4, with tok/s at forced acceptance rates (verdicts forced) (ops/bench_speculative.py);
# whole: the same for the whole model (45 layers) under hybrid offload, the memory plan's automatic placement
#        (the NVFP4 release's MTP layer keeps its FP8-block experts on the device), then on the same engine the
#        prefill of an 8,192-token prompt in the chunks the memory plan chooses from the measured link and matmul
#        rates, as a server's (the host banks' copies a layer ahead).
# PART_TIMEOUT (seconds, default 560) bounds the part, so that two parts fit one call.
# Wheels the machine lacks: see ops/gpu_env.sh.
set -uo pipefail
out=${1:?output directory}; part=${2:?tests, bench or whole}
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1  # kept in the output folder even when a caller's time limit cuts the run
source ops/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
case "$part" in
  tests) timeout "${PART_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_speculative_cuda.py \
           tests/gpu/test_decode_graphs.py "tests/gpu/test_fp8_kernels.py::test_a_split_k_past_k_reads_no_scale_beyond_the_weights" \
           > "$out/tests.log" 2>&1; tail -40 "$out/tests.log" ;;
  bench) timeout "${PART_TIMEOUT:-560}" python3 -m ops.bench_speculative --device cuda --layers 8 --batches 1,4 --drafts 1,2,3 \
           --tokens 64 --json "$out/speculative.json" ;;
  whole) python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
         timeout "${PART_TIMEOUT:-560}" python3 -m ops.bench_speculative --device cuda --layers 45 --expert-slots auto --batches 1,4 \
           --drafts 1,2,3 --acceptance 0.5,0.7,0.9 --tokens 48 --warm-tokens 32 --prefill 8192 --json "$out/speculative_whole.json" ;;
  *) echo "unknown part: $part"; exit 2 ;;
esac
