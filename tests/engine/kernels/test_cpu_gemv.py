"""The compiled CPU GEMVs (NVFP4, FP8 block) against float64 on the dequantized weight, SIMD and portable alike;
each GLMFLASH_CPU_KERNELS mode checked to run the code path it names (what the CPU has, from /proc/cpuinfo),
skipped where this CPU lacks it rather than testing a narrower path again.

`pip install -e .` builds the kernel; a machine where it is not built fails here rather than
silently testing only the torch fallback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

import pytest
import torch

from engine.experts.cpu_experts import CpuExperts
from engine.experts.torch_experts import TorchExperts
from engine.kernels.experts import cpu_gemv
from engine.quant import quantize_fp8_block, quantize_nvfp4
from engine.weights import DenseWeight, Fp8BlockWeight, Nvfp4Weight
from tests.cpu_kernels import assert_expert_close, assert_ran, use_mode, weight_path


def random_nvfp4(n: int, k: int, seed: int, per_row_global: bool = False) -> Nvfp4Weight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)  # every code, both nibbles
    scale = (torch.rand(n, k // 16, generator=g) * 4 + 0.01).to(torch.float8_e4m3fn)
    glob = torch.rand(n if per_row_global else 1, generator=g) + 0.5
    return Nvfp4Weight(packed, scale, glob)


def random_fp8(n: int, k: int, seed: int) -> Fp8BlockWeight:
    """Every finite e4m3 byte (subnormals included; 0x7F and 0xFF are NaN and never stored)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    data[(data & 0x7F) == 0x7F] = 0x01
    blocks = (-(-n // 128), -(-k // 128))
    return Fp8BlockWeight(data.view(torch.float8_e4m3fn), torch.rand(blocks, generator=g) / 64 + 1e-3)


def as_the_kernel_reads(x: torch.Tensor, weight) -> torch.Tensor:
    """x as the kernel's path multiplies it: on the integer NVFP4 paths (AVX2, VNNI) rounded to int16 per 16
    columns (scale: the group's largest |x| over 32639, both in float32, half to even), else unchanged."""
    if not isinstance(weight, Nvfp4Weight) or cpu_gemv.simd_path() not in cpu_gemv.X16_PATHS:
        return x.double()
    groups = x.float().reshape(x.shape[0], -1, 16)
    top = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(32639.0) / top, torch.zeros(()))
    return (torch.round(groups * inverse).double() * (top / 32639.0).double()).reshape(x.shape)


def test_kernel_is_built():
    assert cpu_gemv.available(), "engine/kernels/experts/_cpu_gemv was not built by `pip install -e .`"


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("rows,n,k", [(1, 130, 256), (3, 40, 200), (11, 17, 96), (2, 5, 100)])
def test_fp8_gemv_matches_float64(monkeypatch, mode, rows, n, k):
    """Ragged blocks in both directions (n = 130, k = 200), K not a multiple of 16 (portable path)."""
    path = use_mode(monkeypatch, mode)
    weight = random_fp8(n, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    want = x.double() @ weight.dequantize(torch.float64).t()
    got = cpu_gemv.gemv(x, weight, threads=2)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    assert_ran(weight_path(path, weight))


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("rows,n,k,per_row", [(1, 64, 256, False), (3, 40, 96, True), (11, 17, 512, True),
                                              (2, 9, 48, True), (1, 5, 16, False)])  # odd group counts
def test_gemv_matches_float64(monkeypatch, mode, rows, n, k, per_row):
    """Ragged rows (11 > the kernel's 8-row pass), ragged N, K of one and of many groups."""
    path = use_mode(monkeypatch, mode)
    weight = random_nvfp4(n, k, seed=rows + n, per_row_global=per_row)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    want = as_the_kernel_reads(x, weight) @ weight.dequantize(torch.float64).t()
    got = cpu_gemv.gemv(x, weight, threads=2)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6  # fp32 sums of exact products
    assert_ran(path)


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2"])
def test_every_row_count_of_one_pass_matches_float64(monkeypatch, mode):
    """The SIMD kernels are compiled once per count of x rows (1..8): each count, and 9 (a pass of 8 and
    one of 1), with an odd count of NVFP4 groups (k = 112: 7) and FP8 blocks of 48 (one 16-wide tail)."""
    path = use_mode(monkeypatch, mode)
    nvfp4 = random_nvfp4(24, 112, seed=5, per_row_global=True)
    codes = random_fp8(24, 112, seed=6).data
    fp8 = Fp8BlockWeight(codes, torch.rand(2, 3, generator=torch.Generator().manual_seed(7)) + 0.1, (16, 48))
    for rows in range(1, 10):
        x = torch.randn(rows, 112, generator=torch.Generator().manual_seed(rows))
        for weight in (nvfp4, fp8):
            want = as_the_kernel_reads(x, weight) @ weight.dequantize(torch.float64).t()
            got = cpu_gemv.gemv(x, weight, threads=2)
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, (rows, type(weight).__name__)
    assert_ran(path, weight_path(path, fp8))


def test_gemv_names_a_shape_mismatch():
    with pytest.raises(ValueError, match="against weight"):
        cpu_gemv.gemv(torch.randn(1, 64), random_nvfp4(8, 128, 0), threads=1)


def nvfp4_stacks(d: int, i: int, experts: int, seed: int) -> dict[int, tuple[Nvfp4Weight, ...]]:
    g = torch.Generator().manual_seed(seed)

    def stack(n: int, k: int) -> Nvfp4Weight:
        parts = [quantize_nvfp4(torch.randn(n, k, generator=g) / k ** 0.5) for _ in range(experts)]
        return Nvfp4Weight(*(torch.stack([p[j] for p in parts]) for j in range(3)))

    return {0: (stack(i, d), stack(i, d), stack(d, i))}


def test_the_thread_pool_serves_several_callers_and_a_forked_child():
    """Passes from four threads at once with teams of 1 to 5 (more than this machine's cores: the pool
    grows), each equal to the reference; then a forked child, which has none of the pool's threads."""
    stacks = nvfp4_stacks(128, 96, 6, seed=3)
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randn(3, 128, generator=g), torch.randint(0, 6, (3, 2), generator=g),
              torch.rand(3, 2, generator=g)) for _ in range(4)]
    executors = [CpuExperts(stacks, 1.5, threads=t) for t in (1, 2, 3, 5)]
    singles = [executors[k](0, *cases[k]) for k in range(4)]  # each output element is one thread's: exact
    for got, case in zip(singles, cases):  # the integer paths' int16 inputs: ~1e-5 off the reference
        torch.testing.assert_close(got, TorchExperts(stacks, 1.5)(0, *case), rtol=1e-4, atol=1e-4)
    failures = []

    def caller(k: int) -> None:
        for _ in range(25):
            if not torch.equal(executors[k](0, *cases[k]), singles[k]):
                failures.append(k)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    # The child calls the kernels directly: torch's own OpenMP pool does not survive a fork.
    one_pass = cpu_gemv.ExpertStacks(*stacks[0])
    x, experts, starts, weights = torch.randn(4, 128, generator=g), torch.tensor([1, 4]), torch.tensor([0, 3, 4]), \
        torch.rand(4, generator=g)
    alone = one_pass.forward(x, experts, starts, weights, 1.5, threads=1)
    child = os.fork()
    if child == 0:
        ok = torch.equal(one_pass.forward(x, experts, starts, weights, 1.5, threads=5), alone)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert done[0] == child, "the forked child's pass never returned"
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2", "portable"])
def test_inputs_wider_than_one_preparing_unit_give_every_team_the_same_pass(monkeypatch, mode):
    """The pass prepares each input 1,024 columns a unit and a gate-up tile waits for all of its pair's units:
    2,080 columns (two whole units and a part), every team size equal to one thread exactly, and to the
    reference."""
    path = use_mode(monkeypatch, mode)
    stacks = nvfp4_stacks(2080, 96, 3, seed=7)
    g = torch.Generator().manual_seed(8)
    x, ids, w = torch.randn(3, 2080, generator=g), torch.tensor([[0, 2], [2, 1], [0, 1]]), torch.rand(3, 2, generator=g)
    alone = CpuExperts(stacks, 1.5, threads=1)(0, x, ids, w)
    for team in (2, 3, 7):
        assert torch.equal(CpuExperts(stacks, 1.5, threads=team)(0, x, ids, w), alone)
    torch.testing.assert_close(alone, TorchExperts(stacks, 1.5)(0, x, ids, w), rtol=1e-4, atol=1e-4)
    assert_ran(path)


def quantized_stack(fmt: str, experts: int, n: int, k: int, g: torch.Generator) -> Fp8BlockWeight | Nvfp4Weight:
    """`experts` random [n, k] matrices quantized to FP8 blocks or NVFP4, stacked."""
    weights = [torch.randn(n, k, generator=g) / k ** 0.5 for _ in range(experts)]
    if fmt == "fp8":
        parts = [quantize_fp8_block(w) for w in weights]
        return Fp8BlockWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    parts = [quantize_nvfp4(w) for w in weights]
    return Nvfp4Weight(*(torch.stack([p[j] for p in parts]) for j in range(3)))


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("d,i,tokens", [(128, 64, 5), (96, 80, 12)])
def test_cpu_experts_equal_the_reference_on_quantized_experts(monkeypatch, mode, fmt, d, i, tokens):
    """The compiled expert pass: experts without tokens, an expert with more rows than one pass of the
    kernel takes (12 > 8), widths that are not a multiple of its tiles, an odd count of NVFP4 groups
    (80 / 16), FP8 blocks ragged at 96 and 80."""
    path = use_mode(monkeypatch, mode)
    g = torch.Generator().manual_seed(d + tokens)
    stacks = {0: (quantized_stack(fmt, 6, i, d, g), quantized_stack(fmt, 6, i, d, g), quantized_stack(fmt, 6, d, i, g))}
    x = torch.randn(tokens, d, generator=g)
    ids = torch.stack([torch.tensor([0, 2]) if t % 3 else torch.tensor([5, 2]) for t in range(tokens)])
    w = torch.rand(tokens, 2, generator=g)
    executor = CpuExperts(stacks, 1.5, threads=2)  # a limit the SwiGLU inputs cross
    assert 0 in executor.compiled
    want = TorchExperts(stacks, 1.5)(0, x, ids, w)
    assert_expert_close(executor(0, x, ids, w), want, fmt)
    assert_ran(*(weight_path(path, stack) for stack in stacks[0]))


@pytest.mark.parametrize("mode", ["auto", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_a_group_from_its_first_row_runs_only_its_experts_rows_from_there(monkeypatch, mode, fmt):
    """The CPU's part of an expert split with the device: group g runs intermediate rows [firsts[g], i) (gate
    and up rows, down columns). Against the reference on the same rows (dequantized weights sliced), and the
    two parts of each expert adding up to the whole pass; the same expert whole and split in one pass; a first
    row that is not a multiple of the down block is refused."""
    path = use_mode(monkeypatch, mode)
    d, i = 128, 384
    g = torch.Generator().manual_seed(11)
    gate, up, down = (quantized_stack(fmt, 4, n, k, g) for n, k in ((i, d), (i, d), (d, i)))
    one_pass = cpu_gemv.ExpertStacks(gate, up, down)
    x = torch.randn(5, d, generator=g)
    experts, starts, w = torch.tensor([1, 1, 3]), torch.tensor([0, 2, 3, 5]), torch.rand(5, generator=g)
    firsts = torch.tensor([0, 128, 256])
    dense = [s.dequantize(torch.float32) for s in (gate, up, down)]

    def on_rows(rows_of: Callable[[int], slice]) -> torch.Tensor:
        """Each group's pairs through its expert's intermediate rows `rows_of(first)` only (dequantized)."""
        out = torch.zeros(len(x), d)
        for group, (expert, first) in enumerate(zip(experts.tolist(), firsts.tolist())):
            pairs, rows = slice(starts[group], starts[group + 1]), rows_of(first)
            picked = (dense[0][expert:expert + 1, rows], dense[1][expert:expert + 1, rows],
                      dense[2][expert:expert + 1, :, rows])
            sliced = {0: tuple(DenseWeight(t) for t in picked)}
            ids = torch.zeros(pairs.stop - pairs.start, 1, dtype=torch.long)
            if rows.start != rows.stop:
                out[pairs] = TorchExperts(sliced, 1.5)(0, x[pairs], ids, w[pairs].unsqueeze(1))
        return out

    got = one_pass.forward(x, experts, starts, w, 1.5, threads=3, firsts=firsts)
    assert_expert_close(got, on_rows(lambda first: slice(first, i)), fmt)
    whole = one_pass.forward(x, experts, starts, w, 1.5, threads=3)
    assert_expert_close(got + on_rows(lambda first: slice(0, first)), whole, fmt)
    assert_ran(*(weight_path(path, stack) for stack in (gate, up, down)))
    with pytest.raises(ValueError, match="first row"):
        misaligned = torch.tensor([0, 8 if fmt == "nvfp4" else 64, 0])
        one_pass.forward(x, experts, starts, w, 1.5, threads=1, firsts=misaligned)
