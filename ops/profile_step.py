"""Where a cached agent turn's prefill step spends its host time: the engine loop under cProfile.

The agent workload's later turns hit the prefix cache and compute a few dozen tokens, yet wait for a step
that holds a prefill chunk, and such steps cost far more than a decode step whatever their tokens. This
runs that shape through `EngineCore` directly (no server): `--decoders` requests decoding, then turn after
turn one request whose prompt extends a cached one by `--new-tokens` tokens; each such turn's steps up to
its first token are timed (wall, device synchronized by the sampler) and profiled with cProfile, which
on CUDA sees what the host spends per launch and where it waits. Prints the mean step wall time of those
steps and of plain decode steps, then the top functions by own time and by cumulative time. With
`--profiler torch` the same steps run under torch.profiler instead: the ops and kernels by the device time
they took (CUDA) and that time per step next to the wall time, i.e. how busy the device was.

    python -m ops.profile_step --device cuda                     # the embedded tiny model
    python -m ops.profile_step --model SNAPSHOT --device cuda    # a slice (ops/slice_snapshot.py)
    python -m ops.profile_step --model SNAPSHOT --device cuda --profiler torch
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tiny.factory import write_tiny_model
from ops.bench_engine import device_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a snapshot directory (default: the embedded tiny model, written to a "
                        "temporary directory)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decoders", type=int, default=7, help="requests decoding beside each turn")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the cached prompt of each turn")
    parser.add_argument("--new-tokens", type=int, default=50, help="tokens a turn adds to its cached prompt")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--profiler", choices=("cprofile", "torch"), default="cprofile",
                        help="host functions (cProfile) or ops and kernels by device time (torch.profiler)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_model(Path(tmp) / "tiny", seed=0)
        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.decoders + 1,
                  max_model_len=args.prompt_tokens + args.new_tokens + 4096)
        profile(llm, args)


def profile(llm: LLM, args: argparse.Namespace) -> None:
    core, rng = llm.core, random.Random(0)
    vocab = llm.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    decoding = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    decoders = [llm._sequence(tokens(64), decoding) for _ in range(args.decoders)]
    for seq in decoders:
        core.add(seq)
    while any(not seq.output_token_ids for seq in decoders):
        core.step()
    decode_s = timed_steps(core, 16)
    first_turn = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    turn_steps: list[float] = []
    profiler = cProfile.Profile() if args.profiler == "cprofile" else TorchProfile(core.runner.model.device)
    for turn in range(args.turns + 1):  # the first turn warms the shapes, unprofiled
        prompt = tokens(args.prompt_tokens)
        first = llm._sequence(prompt, first_turn)
        core.add(first)
        while not first.finished:
            core.step()
        later = llm._sequence(prompt + first.output_token_ids + tokens(args.new_tokens), first_turn)
        core.add(later)
        while not later.output_token_ids:
            if turn:
                profiler.enable()
            start = time.perf_counter()
            core.step()
            elapsed = time.perf_counter() - start
            if turn:
                profiler.disable()
                turn_steps.append(elapsed)
    for seq in decoders:
        core.abort(seq.request_id)
    prefix = core.stats().prefix
    print(f"decoders={args.decoders} prompt_tokens={args.prompt_tokens} new_tokens={args.new_tokens} "
          f"turns={args.turns} cached_tokens={prefix.hit_tokens if prefix else 0}", flush=True)
    print(f"decode_step_ms={sum(decode_s) / len(decode_s) * 1e3:.2f} "
          f"turn_steps={len(turn_steps)} turn_step_ms={sum(turn_steps) / len(turn_steps) * 1e3:.2f}", flush=True)
    if isinstance(profiler, TorchProfile):
        profiler.report(len(turn_steps), sum(turn_steps), args.top)
        return
    for sort in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(args.top)
        print(out.getvalue(), flush=True)


class TorchProfile:
    """torch.profiler in cProfile's enable/disable shape: one profile over the steps it is enabled for."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profile = profile(activities=activities)
        self.started = False

    def enable(self) -> None:
        if not self.started:
            self.profile.start()
            self.started = True
        self.profile.toggle_collection_dynamic(True, self.profile.activities)

    def disable(self) -> None:
        self.profile.toggle_collection_dynamic(False, self.profile.activities)

    def report(self, steps: int, wall_s: float, top: int) -> None:
        """Ops and kernels by device time (CPU time without a GPU), and the device's busy share of the steps."""
        self.profile.stop()
        if self.cuda:
            kernels, busy_s = device_kernels(self.profile)
            print(f"kernels_per_step={kernels / steps:.0f} device_ms_per_step={busy_s * 1e3 / steps:.2f} "
                  f"wall_ms_per_step={wall_s * 1e3 / steps:.2f} device_busy={busy_s / wall_s:.2f}", flush=True)
        sort = "cuda_time_total" if self.cuda else "cpu_time_total"
        print(self.profile.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=70), flush=True)


def timed_steps(core: EngineCore, steps: int) -> list[float]:
    """Wall seconds of `steps` engine steps (each ends once its tokens are on the host)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
