#!/usr/bin/env bash
# The image checks and figures on a CUDA machine, in one run (from the repository root):
#   bash ops/gpu_images.sh OUT_DIR [pytest files...]
# 1. a full-width slice with the release's vision tower is written in the background
#    (python3 -m ops.slice_snapshot WORK_DIR/slice --gib SLICE_GIB --vision; SLICE_GIB 20 by default);
# 2. the GPU tests given (default tests/gpu/test_vision_cuda.py), cut at TESTS_S seconds (default 300);
# 3. the tower's time per 1920x1080 image with each attention kernel torch offers (bench_vision --attention);
# 4. the TTFT of a chat request with a 1920x1080 screenshot against its text alone, through glmflash boot on
#    the slice (ops/bench_image_ttft.py).
# Wheels the machine lacks: see ops/gpu_env.sh. OUT_DIR gets slice.log, tests.log, vision-*.json, ttft.json and
# boot.log.
set -uo pipefail
out=${1:?output directory}; shift
tests=${*:-tests/gpu/test_vision_cuda.py}
mkdir -p "$out"
source ops/gpu_env.sh
work=${WORK_DIR:-/tmp/glmflash-images}
python3 -m ops.slice_snapshot "$work/slice" --gib "${SLICE_GIB:-20}" --vision >"$out/slice.log" 2>&1 &
slice=$!
# shellcheck disable=SC2086
timeout "${TESTS_S:-300}" python3 -m pytest -q $tests --durations=12 -p no:cacheprovider -s 2>&1 \
  | tee "$out/tests.log" | grep -E "event=|passed|failed|error|Error|s call|s setup" | tail -40
for attention in default cudnn flash efficient; do
  python3 ops/bench_vision.py --sizes 1920x1080 --batches 1 --attention "$attention" --iters 10 \
    --json "$out/vision-$attention.json" 2>&1 | grep -E "event=vision_tower|Error" | tail -3
done
wait "$slice"; tail -2 "$out/slice.log"
python3 -m ops.bench_image_ttft --model "$work/slice" --cache-dir "$work/cache" --rounds 3 --json "$out/ttft.json" \
  --log "$out/boot.log" -- --device cuda 2>&1 | tail -8
grep -E "PROVISION_STAGE|event=images|Error" "$out/boot.log" | tail -12
