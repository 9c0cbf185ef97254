#!/usr/bin/env bash
# Hybrid offload on a CUDA machine in time-boxed parts (each fits a 10-minute call), from the repo root:
#   bash ops/gpu_hybrid.sh OUT_DIR checks|vnni|executor|whole|skew|slice|swaps|threads|offload|prefill|prefill-chunks|slice-prefill|expert-tiles
# checks: the compiled CPU kernels' tests, the release-shape hybrid tests (split, graphs, swaps, pinning,
#         the kept miss split) and the cost of one GPU<->CPU handshake per layer (ops/bench_handshake.py);
# vnni:   the AVX-512 VNNI NVFP4 path (the default where the CPU has it): the kernels' tests, its speed against
#         the float AVX-512 path (GLMFLASH_CPU_KERNELS=avx512) at 16 and 2 threads;
# executor: the CPU expert pass's rate against the host's read rate on 16 and 2 threads (the 70% target);
# whole: scenario (b), all 45 layers, uniform routing, the miss split measured at load;
# skew:  the same under a Zipf-like routing trace with swaps on;
# slice: scenario (a), a 32 GB-class budget (18 slots per MoE layer) on an 8-layer slice;
# swaps: the same slice without swaps and with its CPU threads unpinned, each against the default, in one run
#        (what the settled placement gives against none, what pinning does with swaps running; ops.bench_decode
#        times each once the swaps have settled);
# threads: an 8-layer slice with every miss on the CPU at 14, 15 and 16 CPU threads (the default is every
#          core but one; more threads than cores should degrade, not stall), then the default unpinned.
# prefill: the whole model's prefill at 2,048 and 8,192 tokens (chunks of 8,192), then the top ops of an 8,192-token
#          prefill by device and host time against its wall time (where the link, the syncs and the math go);
# slice-prefill: the GPU's own part of a prefill (no link): an 8-layer slice with every expert resident, one chunk
#          each of 8,192 and 32,768 tokens, and the top ops of each;
# prefill-chunks: the whole model's prefill of 8,192- and 32,768-token prompts in steps of the length the memory plan
#          chooses from the link's and the matmul's measured rates (auto), of 2,048 and of 8,192 tokens (a lone
#          prompt's budget, --max-prefill-tokens; decode steps keep 2,048): what a longer chunk gains once the link
#          bounds a 2,048-token one, and whether the automatic choice finds it (CHUNKS: other lengths, e.g. "auto");
# expert-tiles: the routed experts' prefill kernels (ops/bench_experts.py, 8,192 and 32,768 tokens: 227 and 910 pairs an
#          expert) at the default launch shape (from 128 pairs an expert on: 128 rows, the weights first in the MMA),
#          at the former 128-row one (the activations first, 8 warps, 2 stages), with 128 weight rows a program on 8
#          warps (16 a warp, as the wgmma splits them: 64 rows on 8 warps repeat each warp's dequantization), at 64
#          rows, and on the same experts dequantized to bf16 (the GEMMs without the dequantization);
# offload: whole, swaps and skew one after the other (~6 minutes on a fresh H200 machine), each part's output
#          under OUT_DIR/<part>.
# Wheels the machine lacks: see ops/gpu_env.sh.
set -uo pipefail
out=${1:?output directory}; part=${2:?checks, vnni, executor, whole, skew, slice, swaps, threads, offload, prefill, prefill-chunks, slice-prefill or expert-tiles}
if [ "$part" = offload ]; then
  for each in whole swaps skew; do bash "$0" "$out/$each" "$each"; done
  exit 0
fi
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1  # kept in the output folder even when a caller's time limit cuts the run
source ops/gpu_env.sh
# Always: a machine that keeps build outputs between calls may hold a library built from older sources.
python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
decode="python3 -m ops.bench_decode --device cuda --expert-variety 8 --steps 16 --contexts 1024 --batches 4 --prefills 2048 --reference-layers 0"
case "$part" in
  checks) timeout 480 python3 -m pytest -q tests/engine/kernels/test_cpu_gemv.py tests/gpu/test_hybrid_cuda.py -k "gemv or pool or release or pinned or miss_split" 2>&1 | tail -15
          for rows in 1 4; do timeout 40 python3 -m ops.bench_handshake --device cuda --layers 42 --rows $rows; done ;;
  vnni) # the AVX-512 VNNI path (x in int16, the default): the kernels' tests, then against float AVX-512 on 16 and 2 threads
        timeout 90 python3 -m pytest -q tests/engine/kernels/test_cpu_gemv.py 2>&1 | tail -3
        for t in 16 2; do for mode in avx512 auto; do
          GLMFLASH_CPU_KERNELS=$mode timeout 100 python3 -m ops.bench_cpu_moe --threads $t --spin-us 2000 --json
        done; done ;;
  executor) for t in 16 2; do
              timeout 90 python3 -m ops.bench_cpu_moe --threads $t --spin-us 2000 --pin --steps 20 --rounds 3 --json
            done ;;
  whole) timeout 540 $decode --layers 45 --expert-slots auto --max-expert-swaps 0 --json "$out/whole.json" 2>&1 | tail -45 ;;
  skew) timeout 540 $decode --layers 45 --expert-slots auto --routing-skew 2 --json "$out/skew.json" 2>&1 | tail -45 ;;
  slice) timeout 540 $decode --layers 8 --expert-slots 18 --json "$out/slice.json" 2>&1 | tail -45 ;;
  swaps) for flags in "" "--max-expert-swaps 0" "--no-cpu-pin"; do  # the first run also compiles: 180 s
           echo "== 8 layers, 18 slots ${flags:-(swaps on, at most 4 a step, pinned)}"
           timeout 180 $decode --layers 8 --expert-slots 18 --prefills 512 $flags 2>&1 \
             | grep -E "event=(cpu_experts|miss_split)|warm_steps|step_ms|cpu_GBps|hit_rate|swaps_per_step|extrapolated"
         done ;;
  threads) for t in 14 15 16; do
             echo "== $t threads"
             timeout 120 $decode --layers 8 --expert-slots 197 --pcie-percent 0 --max-expert-swaps 0 --prefills 512 \
               --cpu-threads $t --json "$out/threads$t.json" 2>&1 | grep -E "step_ms|cpu_GBps|event=cpu_experts"
           done
           echo "== 15 threads, unpinned"
           timeout 120 $decode --layers 8 --expert-slots 197 --pcie-percent 0 --max-expert-swaps 0 --prefills 512 \
             --no-cpu-pin --json "$out/unpinned.json" 2>&1 | grep -E "step_ms|cpu_GBps|event=cpu_experts" ;;
  prefill) timeout 560 python3 -m ops.bench_decode --device cuda --expert-variety 8 --steps 4 --contexts 1024 --batches "" \
             --prefills 2048,8192 --reference-layers 0 --layers 45 --expert-slots auto --max-expert-swaps 0 \
             --profile-prefill 8192 --json "$out/prefill.json" 2>&1 | tail -120 ;;
  prefill-chunks) for n in ${CHUNKS:-auto 2048 8192}; do
                    echo "== steps of $n tokens"
                    timeout 190 python3 -m ops.bench_decode --device cuda --expert-variety 8 --steps 4 --contexts 1024 \
                      --batches "" --prefills 8192,32768 --reference-layers 0 --layers 45 --expert-slots auto \
                      --max-expert-swaps 0 --max-prefill-tokens $n --json "$out/prefill_chunks_$n.json" 2>&1 \
                      | grep -E "expert_slots|event=(memory_plan|miss_split|expert_placement|prefill_chunk)|prefill|build_s|extrapolated"
                  done ;;
  slice-prefill) for n in 8192 32768; do
                   timeout 220 python3 -m ops.bench_decode --device cuda --expert-variety 8 --steps 4 --contexts 1024 \
                     --batches "" --prefills $n --reference-layers 0 --layers 8 --profile-prefill $n \
                     --json "$out/slice_prefill$n.json" 2>&1 | tail -100
                 done ;;
  expert-tiles) for run in nvfp4:'{}' nvfp4:'{"weights_first": false, "num_warps": 8, "num_stages": 2}' \
                           nvfp4:'{"num_warps": 8, "block_n": 128, "block_k": 32}' nvfp4:'{"num_warps": 8, "block_n": 128}' \
                           nvfp4:'{"block_m": 64}' bf16:'{}'; do
                  echo "== ${run%%:*} experts, prefill tiles ${run#*:}"
                  timeout 120 python3 -m ops.bench_experts --decode 1 --prefill 8192,32768 --repeats 3 \
                    --weights "${run%%:*}" --prefill-tiles "${run#*:}" 2>&1 | grep -E "^(prefill|path|NVIDIA)"
                done ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac
