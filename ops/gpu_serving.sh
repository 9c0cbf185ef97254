#!/usr/bin/env bash
# The serving figures measured on a CUDA machine, in one run cut at BUDGET_S seconds (default 540), from the
# repository root:  bash ops/gpu_serving.sh OUT_DIR [tests] [boot] [serve] [long] [soak]   (default: the first three,
# in this order)
# tests: the prefix cache, structured output, the compiled-kernel manifest, fla's shipped configs and the KDA
#        kernels on CUDA:
#          python3 -m pytest -q tests/gpu/test_prefix_cache_cuda.py tests/gpu/test_structured_cuda.py \
#              tests/gpu/test_kernel_manifest_cuda.py tests/gpu/test_fla_tuning_cuda.py tests/gpu/test_kda_kernels.py
# boot:  process start to /ready and to the first token, cold and fast_resume, against raw reads of the same
#        bytes with the page cache dropped, and decode while the cold start's prepared snapshot is written against
#        decode after it; then the same with early readiness (tok/s while experts fill in; PARTIAL=0 skips it).
#        On a full-width NVFP4 slice on the local disk, its prepared snapshot beside it in WORK_DIR/cache:
#          python3 -m ops.slice_snapshot WORK_DIR/slice --gib SLICE_GIB [--layers SLICE_LAYERS]
#          python3 -m ops.bench_boot --cache-dir WORK_DIR/cache --model WORK_DIR/slice [--ready-at partial] \
#              -- --device cuda
# serve: the multi-turn agent workload on that slice, prefix cache on and off (8 conversations of 8 turns over a
#        330-word system prompt, ~2,000 tokens with the slice's byte-level tokenizer, plus tools; 16-token
#        answers; the servers start from the prepared snapshot), then what grammar masks add to a decode step:
#          python3 ops/bench_serve.py --workload agent --serve WORK_DIR/slice --device cuda $AGENT_ARGS
#          python3 ops/bench_structured.py --model WORK_DIR/slice --device cuda --dtype bfloat16 --batch 1 16
#        (the release's vocabulary: the masks' size; the tiny model's without a slice)
# long:  TTFT and decode of an ~8k-token prompt through HTTP on the slice (1,400 random words, ~5.9 tokens a word
#        with the slice's byte-level tokenizer; 3 requests one at a time, 128 tokens each; the server's defaults
#        but max_model_len 12,288):
#          python3 ops/bench_serve.py --serve WORK_DIR/slice --device cuda --concurrency 1 --requests-per-level 3 \
#              --prompt-tokens 1400 --max-tokens 128 --endpoint completions --ignore-eos
# soak:  SOAK_S seconds (default 300) at 32 concurrent streams of mixed kinds and lengths on the slice, 10% of the
#        clients leaving mid-stream, then SIGTERM with requests in flight (the server starts from the boot part's
#        prepared snapshot where there is one):
#          python3 -m ops.soak --serve WORK_DIR/slice --device cuda --seconds SOAK_S --streams 32 --max-tokens 256
# EXPERT_BUDGET_GIB runs every server in hybrid mode (GLMFLASH_MOE_VRAM_BUDGET_GIB: that many GiB of routed experts
# on the GPU, the rest in host RAM), e.g. SLICE_GIB=20 EXPERT_BUDGET_GIB=4 PARTIAL=0 bash ops/gpu_serving.sh OUT boot,
# then (a call of its own: the soak takes SOAK_S + ~90 s, the boot part ~310 s with the slice and prebuilt kernels
# made) SLICE_GIB=20 EXPERT_BUDGET_GIB=4 bash ops/gpu_serving.sh OUT soak on the same machine.
# Any other GLMFLASH_ setting in the environment reaches every server too, e.g. GLMFLASH_MAX_PREFILL_TOKENS=8192 with
# EXPERT_BUDGET_GIB for the long part's prompt in longer steps.
# SLICE_GIB is 12 by default (10.6 GiB: 2 MoE layers of 288 experts), what fits beside the other parts: each
# boot run reads the slice six times and writes it once (~1.5 GB/s on an H200 machine's disk). The issue's
# >= 20 GB (SLICE_GIB=20: 18.8 GiB, 4 layers, one of them DSA) fits a run without the tests:
#          SLICE_GIB=20 bash ops/gpu_serving.sh OUT_DIR boot serve
# SLICE_LAYERS fixes the slice's depth instead (its experts per layer what SLICE_GIB allows): SLICE_LAYERS=12
# gives the release's 3:1 KDA:DSA mix and per-layer prefill work (38 experts a layer at 12 GiB), the slice the
# agent workload's TTFT is reported on.
# Each cold start also compiles the full-width Triton kernels (beside its reads: 30-50 s on an H200, fla's tuning
# shipped), less what the image's build compiled: as the Docker image does, the boot part first compiles the
# package's manifests into WORK_DIR/prebuilt (`python -m engine.kernels.prebuilt`, timed; PREBUILT=0 leaves it
# out) and the servers copy them in (GLMFLASH_PREBUILT_KERNELS); later starts on the same cache read them back.
# Each step is cut at the time left less what later steps keep, and its figures are printed as measured.
# DEVICE=cpu checks the script on a CPU machine (with SLICE_GIB=0.3: the smallest slice, 2.8 GiB; AGENT_ARGS,
# STRUCTURED_ARGS to shrink the workloads). Wheels the machine lacks: see ops/gpu_env.sh. OUT_DIR gets run.log
# (all that is printed), env.log, tests.log, boot.log, serve.log, soak.log, agent.json, structured.json, soak.json,
# long.json, server-logs.tgz
# (the output of each server bench_boot and bench_serve started) and kernels.tgz (the boot's kernel manifest,
# Triton's autotuning results and a list of its cache's files).
set -uo pipefail
out=${1:?output directory}; shift
parts=${*:-tests boot serve}
for part in $parts; do [[ " tests boot serve long soak " == *" $part "* ]] || { echo "unknown part: $part" >&2; exit 2; }; done
mkdir -p "$out"
budget=${BUDGET_S:-540} start=$(date +%s); deadline=$((start + budget))
exec > >(tee -a "$out/run.log") 2>&1
device=${DEVICE:-cuda}
dtype=$([ "$device" = cuda ] && echo bfloat16 || echo float32)
slice_gib=${SLICE_GIB:-12}
slice_layers=${SLICE_LAYERS:-}
agent_args=${AGENT_ARGS:---conversations 8 --turns 8 --system-tokens 330 --user-tokens 8 --max-tokens 16 --ignore-eos}
structured_args=${STRUCTURED_ARGS:---batch 1 16}
has() { [[ " $parts " == *" $1 "* ]]; }

# step CAP RESERVE LOG COMMAND...: the command under a limit of CAP seconds or the time left less RESERVE (what
# later steps keep), whichever is less, both sized for a budget of 540 s; a larger BUDGET_S scales them up, a
# smaller one leaves the caps (a step cut below what it needs measures nothing) and lets the later steps go short.
step() {
  local scale=$((budget > 540 ? budget : 540))
  local cap=$(($1 * scale / 540)) reserve=$(($2 * budget / 540)) log=$3; shift 3
  local limit=$((deadline - $(date +%s) - reserve)); ((limit > cap)) && limit=$cap
  if ((limit < 20)); then echo "== skipped, ${limit}s left for: $*" | tee -a "$log"; return 124; fi
  echo "== $* (limit ${limit}s, at $(($(date +%s) - start))s)" | tee -a "$log"
  local pidfile; pidfile=$(mktemp)
  { timeout -k 15 "$limit" "$@" 2>&1 & echo $! > "$pidfile"; wait $!; } | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  # A server the command started outlives it when the limit cuts it (SIGTERM only asks a server to drain, after
  # its load): the rest of timeout's process group goes too, so the next step has the GPU to itself.
  kill -KILL -- "-$(cat "$pidfile")" 2>/dev/null && echo "== stopped what it left running" | tee -a "$log"
  rm -f "$pidfile"
  echo "== rc=$rc after $(($(date +%s) - start))s" | tee -a "$log"
  return "$rc"
}

source ops/gpu_env.sh
{
  [ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "cores $(nproc)"; free -g | head -2; git log -1 --format='commit %h %s' 2>/dev/null
} 2>&1 | tee -a "$out/env.log"
# Always: a machine that keeps build outputs between calls may hold a library built from older sources.
step 150 0 "$out/env.log" python3 setup.py -q build_ext --inplace

# The slice and the prepared snapshot on the local disk (not tmpfs: its reads would be memory reads).
work=${WORK_DIR:-}
if [ -z "$work" ]; then
  for dir in /root /tmp; do
    [ -w "$dir" ] && [[ "$(df --output=fstype "$dir" | tail -1)" != *tmpfs* ]] && { work=$dir/glmflash-serving; break; }
  done
fi
work=${work:-/tmp/glmflash-serving}
mkdir -p "$work"
slice=$work/slice cache=$work/cache
rm -rf "$work/logs"  # the servers' own logs of this run (server-logs.tgz)

soak_s=${SOAK_S:-300}
[ -n "${EXPERT_BUDGET_GIB:-}" ] && export GLMFLASH_MOE_VRAM_BUDGET_GIB=$EXPERT_BUDGET_GIB
reserve_soak=$(has soak && echo $((soak_s + 90)) || echo 0)  # its start, the soak, the drain
reserve_long=$(has long && echo 120 || echo 0)
reserve_serve=$(( $(has serve && echo 130 || echo 0) + reserve_long + reserve_soak ))
reserve_boot=$(has boot && echo 200 || echo 0)

if has tests; then
  echo "### tests"
  step 150 $((reserve_boot + reserve_serve)) "$out/tests.log" \
    python3 -m pytest -q tests/gpu/test_prefix_cache_cuda.py tests/gpu/test_structured_cuda.py \
      tests/gpu/test_kernel_manifest_cuda.py tests/gpu/test_fla_tuning_cuda.py tests/gpu/test_kda_kernels.py >/dev/null
  tail -15 "$out/tests.log"
fi

if has boot; then
  echo "### boot"
  rm -rf "$cache/models"  # bench_boot starts each round without a prepared snapshot anyway
  [ "$(cat "$work/slice.gib" 2>/dev/null)" = "$slice_gib $slice_layers" ] && [ -e "$slice/model.safetensors.index.json" ] \
    || rm -rf "$slice" "$work/slice.gib"
  free_gib=$(df -B1G --output=avail "$work" | tail -1 | tr -d ' ')
  built=$([ -e "$slice/model.safetensors.index.json" ] && echo 0 || echo 1)
  # the slice (unless kept from an earlier run) and its prepared copy (about as large), and 3 GiB to spare
  fits=$(awk -v f="$free_gib" -v b="$built" 'BEGIN { g = (f - 3) / (1.1 + b); print (g < 0 ? 0 : int(g)) }')
  if awk -v s="$slice_gib" -v g="$fits" 'BEGIN { exit !(s > g) }'; then
    echo "note: $free_gib GiB free in $work: the slice shrinks from $slice_gib to $fits GiB"
    slice_gib=$fits; rm -rf "$slice" "$work/slice.gib"
  fi
  df -h "$work" | tee -a "$out/env.log"
  if [ ! -e "$slice/model.safetensors.index.json" ]; then
    step 120 $((160 + reserve_serve)) "$out/boot.log" python3 -m ops.slice_snapshot "$slice" --gib "$slice_gib" \
      ${slice_layers:+--layers "$slice_layers"} && echo "$slice_gib $slice_layers" > "$work/slice.gib"
  fi
  if [ "${PREBUILT:-$([ "$device" = cuda ] && echo 1 || echo 0)}" = 1 ]; then  # what the image's build compiles
    rm -rf "$work/prebuilt"
    step 90 $((200 + reserve_serve)) "$out/boot.log" python3 -m engine.kernels.prebuilt "$work/prebuilt" \
      && export GLMFLASH_PREBUILT_KERNELS=$work/prebuilt
  fi
  # ~225 s on the 20 GB slice in hybrid mode (the prepared write alone ~100 s at the busy pace), ~150 s resident
  partial=${PARTIAL:-1}
  step 260 $(( $([ "$partial" = 1 ] && echo 80 || echo 0) + reserve_serve)) "$out/boot.log" \
    python3 -m ops.bench_boot --cache-dir "$cache" --model "$slice" --log-dir "$work/logs" -- --device "$device"
  [ "$partial" = 1 ] && step 200 "$reserve_serve" "$out/boot.log" \
    python3 -m ops.bench_boot --cache-dir "$cache" --model "$slice" --ready-at partial --log-dir "$work/logs" \
      -- --device "$device"
  tar czf "$out/server-logs.tgz" -C "$work" logs  # each start's own log: its stages, event= lines, compiles
  # What the starts compiled: the kernel manifest, Triton's autotuning choices and its cache's files by kernel.
  (cd "$cache" && find models -name kernels.json; find triton -name '*.autotune.json') > "$work/kernel-files"
  find "$cache/triton" -type f -printf '%f %s\n' | sort > "$cache/triton-files.txt"
  tar czf "$out/kernels.tgz" -C "$cache" triton-files.txt $(cat "$work/kernel-files")
fi

if has serve; then
  echo "### serve"
  # GLMFLASH_CACHE_DIR: the servers start from the boot part's prepared snapshot (fast_resume), not a second copy.
  if [ -e "$slice/model.safetensors.index.json" ]; then
    step 240 50 "$out/serve.log" python3 ops/bench_serve.py --workload agent --serve "$slice" --device "$device" \
      --serve-env "GLMFLASH_CACHE_DIR=$cache" --server-log "$work/logs" $agent_args --json "$out/agent.json"
    tar czf "$out/server-logs.tgz" -C "$work" logs
  else
    echo "no slice in $slice: run the boot part first" | tee -a "$out/serve.log"
  fi
  model_arg=$([ -e "$slice/model.safetensors.index.json" ] && echo "--model $slice")
  step 120 0 "$out/serve.log" python3 ops/bench_structured.py $model_arg --device "$device" --dtype "$dtype" \
    $structured_args --json "$out/structured.json"
fi
if has long; then
  echo "### long"
  if [ -e "$slice/model.safetensors.index.json" ]; then
    step 200 "$reserve_soak" "$out/long.log" python3 ops/bench_serve.py --serve "$slice" --device "$device" \
      --serve-env "GLMFLASH_CACHE_DIR=$cache" --serve-env GLMFLASH_MAX_MODEL_LEN=12288 --server-log "$work/logs" \
      --concurrency 1 --requests-per-level 3 --prompt-tokens 1400 --max-tokens 128 --endpoint completions \
      --ignore-eos --json "$out/long.json"
  else
    echo "no slice in $slice: run the boot part first" | tee -a "$out/long.log"
  fi
fi

if has soak; then
  echo "### soak"
  if [ -e "$slice/model.safetensors.index.json" ]; then
    step $((soak_s + 150)) 0 "$out/soak.log" python3 -m ops.soak --serve "$slice" --device "$device" \
      --cache-dir "$cache" --seconds "$soak_s" --streams 32 --max-tokens 256 --json "$out/soak.json"
    tail -40 "$out/soak.log"
  else
    echo "no slice in $slice: run the boot part first" | tee -a "$out/soak.log"
  fi
fi
echo "### done in $(($(date +%s) - start))s"
