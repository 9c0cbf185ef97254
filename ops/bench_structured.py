"""What structured-output masks add to a decode step, with the tiny model (or any snapshot).

At each batch size, B requests decode the same number of steps twice: free, and each constrained by
a JSON schema whose shortest answer is longer than the run (every step is masked, nobody finishes
early). Reported per decode step (medians over the steps of all repeats, free and constrained runs
interleaved): the step time of each, the masks' overhead in % of the free step, and where it goes:
filling the bitmask on the CPU (in the helper thread, overlapped with the forward), the time the
step then still waited for it, queuing its application to the logits (host time: on a GPU the copy
and the fill run behind the forward, and timing them with a synchronization would keep the host from
queuing the sampler meanwhile, which a served step does), and feeding the sampled tokens to the
matchers; "serial" is the last three, the host's part the forward cannot hide, in % of the free step.

    python ops/bench_structured.py --device cpu --batch 1 16        # the figures in ops/BENCHMARKS.md
    python ops/bench_structured.py --device cuda --dtype bfloat16 --batch 1 16
    python ops/bench_structured.py ... --profile   # then the top ops of free and constrained steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.structured import GrammarSpec, RequestConstraint
from engine.tiny.factory import write_tiny_model

ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}  # no answer ends within a benchmark run


class StepClock:
    """Wall time of the mask work inside each step, by wrapping the engine's own methods (benchmark only)."""

    def __init__(self, llm: LLM) -> None:
        self.parts: dict[str, float] = {"fill": 0.0, "wait": 0.0, "apply": 0.0, "accept": 0.0}
        masks = llm.core.masks
        fill, apply, accept = masks._fill, masks.apply, RequestConstraint.accept

        def timed_fill(seqs):
            start = time.perf_counter()
            fill(seqs)
            self.parts["fill"] += time.perf_counter() - start

        def timed_apply(logits, pending):
            start = time.perf_counter()
            pending.filled.result()
            waited = time.perf_counter()
            apply(logits, pending)
            self.parts["wait"] += waited - start
            self.parts["apply"] += time.perf_counter() - waited

        def timed_accept(constraint, token):
            start = time.perf_counter()
            accept(constraint, token)
            self.parts["accept"] += time.perf_counter() - start

        masks._fill, masks.apply = timed_fill, timed_apply
        self._restore = lambda: (delattr(masks, "_fill"), delattr(masks, "apply"),
                                 setattr(RequestConstraint, "accept", accept))
        RequestConstraint.accept = timed_accept

    def take(self) -> dict[str, float]:
        parts, self.parts = self.parts, dict.fromkeys(self.parts, 0.0)
        return parts

    def close(self) -> None:
        self._restore()


def decode_steps(llm: LLM, batch: int, steps: int, grammar: GrammarSpec | None, clock: StepClock,
                 seed: int) -> list[dict[str, float]]:
    """Per decode step: its wall time and the mask parts (seconds); the prefill step is left out."""
    core, device = llm.core, llm.model.device
    params = SamplingParams(max_tokens=steps + 1, temperature=1.0, ignore_eos=True, grammar=grammar)
    for i in range(batch):
        core.add(Sequence(f"{seed}-{i}", list(f"request {seed} {i}:".encode()), params))
    core.step()  # every prompt is prefilled (and its first token sampled) in this step
    clock.take()
    out = []
    while core.has_work:
        start = time.perf_counter()
        core.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append({"step": time.perf_counter() - start, **clock.take()})
    return out


def profile_steps(llm: LLM, batch: int, grammar: GrammarSpec, steps: int = 8) -> None:
    """Top ops of `steps` free and then `steps` constrained decode steps at `batch` (graphs as served): what
    a constrained step adds, by op, on the host and on the device."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    clock = StepClock(llm)
    try:
        for name, spec in (("free", None), ("constrained", grammar)):
            with profile(activities=activities) as prof:
                decode_steps(llm, batch, steps, spec, clock, seed=1000 + batch)
            print(f"profile: {name}, batch {batch}, {steps} decode steps and their prefill", flush=True)
            for sort in ("self_cpu_time_total", *(["self_cuda_time_total"] if cuda else [])):
                print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)
    finally:
        clock.close()


def run(args: argparse.Namespace) -> dict:
    snapshot = Path(args.model) if args.model else write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "bf16", 0)
    llm = LLM(model=snapshot, device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch))
    grammar = GrammarSpec.json_schema(LONG_SCHEMA)
    clock = StepClock(llm)
    cases = []
    try:
        decode_steps(llm, max(args.batch), 4, grammar, clock, seed=-1)  # warm-up: kernels, the vocabulary trie
        for batch in args.batch:
            free, constrained = [], []
            for repeat in range(args.repeats):
                free += decode_steps(llm, batch, args.steps, None, clock, seed=2 * repeat)
                constrained += decode_steps(llm, batch, args.steps, grammar, clock, seed=2 * repeat + 1)
            median = lambda rows, key: statistics.median(r[key] for r in rows) * 1e3  # noqa: E731 - ms
            case = {"batch": batch, "steps": len(constrained), "free_step_ms": median(free, "step"),
                    "constrained_step_ms": median(constrained, "step"),
                    **{f"{part}_ms": median(constrained, part) for part in ("fill", "wait", "apply", "accept")}}
            case["mask_ms"] = case["constrained_step_ms"] - case["free_step_ms"]
            case["overhead_pct"] = 100 * case["mask_ms"] / case["free_step_ms"]
            # What the step cannot overlap with its forward (the fill runs beside it): a figure that machine
            # noise in the two step medians does not blur.
            case["serial_ms"] = case["wait_ms"] + case["apply_ms"] + case["accept_ms"]
            case["serial_pct"] = 100 * case["serial_ms"] / case["free_step_ms"]
            cases.append(case)
    finally:
        clock.close()
    if args.profile:
        profile_steps(llm, max(args.batch), grammar)
    return {"device": str(llm.model.device), "dtype": args.dtype, "model": args.model or "tiny",
            "vocab": llm.config.vocab_size, "cases": cases}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="snapshot directory (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=64, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="free/constrained run pairs per batch size")
    parser.add_argument("--json", help="also write the results to this path")
    parser.add_argument("--profile", action="store_true", help="then print the top ops of free and constrained "
                        "steps at the largest batch")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"device={result['device']} dtype={result['dtype']} vocab={result['vocab']}")
    print("batch  free ms  constrained ms  overhead  fill ms  waited ms  apply ms  accept ms  serial")
    for c in result["cases"]:
        print(f"{c['batch']:>5}  {c['free_step_ms']:7.2f}  {c['constrained_step_ms']:14.2f}  {c['overhead_pct']:7.1f}%"
              f"  {c['fill_ms']:7.3f}  {c['wait_ms']:9.3f}  {c['apply_ms']:8.3f}  {c['accept_ms']:9.3f}"
              f"  {c['serial_pct']:5.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
