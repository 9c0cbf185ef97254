"""The compiled CPU expert kernels (cpu_gemv.c) behind torch-shaped calls, and whether they are built.

`pip install -e .` compiles them where a C compiler exists; elsewhere `available()` is False and the
CPU expert executor keeps its torch path. GLMFLASH_CPU_KERNELS picks the path: `auto` (the widest the
CPU has), `avx512` (AVX-512 without VNNI's integer NVFP4 path), `avx2`, `portable` (plain C), `torch`
(the compiled kernels off), for comparisons. The AVX2 and AVX-512 VNNI paths run NVFP4 with x in 16-bit
integers, rounded to 1/65278 of each 16 columns' largest value (finer than the bf16 activations it starts
from): with VNNI 6% faster than the float AVX-512 path on 16 threads, 22% on 2 (ops/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import torch

from engine.weights import Fp8BlockWeight, Nvfp4Weight

_MODULE = "engine.kernels.experts._cpu_gemv"
_P = ctypes.c_void_p
_I = ctypes.c_int64
_LEVELS = {"auto": 3, "avx512": 2, "avx2": 1, "portable": 0}
X16_PATHS = (1, 3)  # cpu_gemv.c's AVX2 and AVX512_VNNI: NVFP4 rows of x rounded to int16 per group of 16
QuantWeight = Nvfp4Weight | Fp8BlockWeight


class Matrix(ctypes.Structure):
    """cpu_gemv.c's `matrix`: a quantized matrix or a stack of them, by pointer (the tensors stay owned
    by torch; `keep` holds the contiguous ones the pointers come from)."""

    _fields_ = [("format", ctypes.c_int32), ("n", _I), ("k", _I), ("data", _P), ("scales", _P), ("factors", _P),
                ("global_stride", _I), ("bn", _I), ("bk", _I)]


def matrix(weight: QuantWeight) -> tuple[Matrix, tuple[torch.Tensor, ...]]:
    """A C view of an NVFP4 or FP8-block weight [..., N, K] (a stack: every matrix alike), and the tensors
    it points into, which must outlive it."""
    n, k = weight.shape[-2:]
    if isinstance(weight, Nvfp4Weight):
        codes, scales = weight.packed.contiguous(), weight.scale.contiguous().view(torch.uint8)
        glob = weight.global_scale.float().contiguous()
        per_row = glob.shape[-1] if glob.dim() else 1
        if per_row not in (1, n):
            raise ValueError(f"NVFP4 weight {weight.shape} with a global scale of shape {tuple(glob.shape)}")
        keep = (codes, scales, glob)
        m = Matrix(0, n, k, codes.data_ptr(), scales.data_ptr(), glob.data_ptr(), int(per_row == n and n > 1), 0, 0)
    else:
        data, scale_inv = weight.data.contiguous().view(torch.uint8), weight.scale_inv.float().contiguous()
        bn, bk = weight.block
        keep = (data, scale_inv)
        m = Matrix(1, n, k, data.data_ptr(), None, scale_inv.data_ptr(), 0, bn, bk)
    return m, keep


class HostStepArgs(ctypes.Structure):
    """cpu_gemv.c's `host_step_args`: one MoE layer's CPU share of a decode step, by pointer (the caller
    owns every buffer and keeps it alive and in place as long as the struct is used)."""

    _fields_ = [("gate", ctypes.POINTER(Matrix)), ("up", ctypes.POINTER(Matrix)), ("down", ctypes.POINTER(Matrix)),
                ("x", _P), ("ids", _P), ("weights", _P), ("cpu_entry", _P), ("live_rows", _P),
                ("rows", _I), ("topk", _I), ("num_experts", _I), ("pcie_percent", _I), ("pcie_capacity", _I),
                ("split_units", _I),
                ("limit", ctypes.c_float),
                ("out", _P), ("workspace", _P), ("scratch", _P), ("fp8_table", _P),
                ("threads", ctypes.c_int32), ("level", ctypes.c_int32), ("spin_ns", _I), ("status", ctypes.c_int32),
                ("steps", _I), ("pairs_seen", _I), ("pairs_missed", _I), ("pairs_run", _I), ("experts_run", _I),
                ("units_left", _I), ("nanoseconds", _I)]


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.gemv.argtypes = [ctypes.POINTER(Matrix), _P, _I, _P, _P, ctypes.c_int, ctypes.c_int]
    lib.gemv.restype = ctypes.c_int
    lib.experts_forward.argtypes = ([ctypes.POINTER(Matrix)] * 3 + [_P, _I, _I, _P, _P, _P, _P, ctypes.c_float, _P, _P,
                                                                    _P, ctypes.c_int, ctypes.c_int, _I])
    lib.experts_forward.restype = ctypes.c_int
    lib.host_step.argtypes = [_P]
    lib.host_step.restype = None
    lib.pool_pin.argtypes = [_P, ctypes.c_int]
    lib.pool_pin.restype = None
    lib.simd_path.argtypes = [ctypes.c_int]
    lib.simd_path.restype = ctypes.c_int
    lib.take_paths_run.argtypes = []
    lib.take_paths_run.restype = ctypes.c_int
    lib.doorbell_open.argtypes = [_P, _P, _P, _I]
    lib.doorbell_open.restype = _P
    lib.doorbell_arm.argtypes = [_P]
    lib.doorbell_arm.restype = None
    lib.doorbell_close.argtypes = [_P]
    lib.doorbell_close.restype = None
    return lib


def _built() -> ctypes.CDLL:
    """The library, for callers that checked `available()` first."""
    lib = _library()
    assert lib is not None, "the CPU kernels are not built: check available() first"
    return lib


def _mode() -> str:
    return os.environ.get("GLMFLASH_CPU_KERNELS", "auto")


def available() -> bool:
    """Whether the compiled kernels are built and not switched off."""
    return _mode() != "torch" and _library() is not None


def host_step_function() -> int:
    """Address of cpu_gemv.c's `host_step(void *args)`: a CUDA host function, or called directly."""
    lib = _built()
    return ctypes.cast(lib.host_step, _P).value


def run_host_step(args: HostStepArgs) -> None:
    """Runs one host step now, on this thread."""
    lib = _built()
    lib.host_step(ctypes.addressof(args))


def open_doorbell(ring: int, done: int, table: int, spin_ns: int) -> int:
    """Starts doorbell.c's listener on these words (addresses; table: host_step_args addresses by index)
    -> its handle."""
    lib = _built()
    handle = lib.doorbell_open(ring, done, table, spin_ns)
    if not handle:
        raise RuntimeError("doorbell: the listener thread did not start")
    return handle


def arm_doorbell(handle: int) -> None:
    """Wakes the listener if it naps (a step is about to ring it)."""
    _built().doorbell_arm(handle)


def close_doorbell(handle: int) -> None:
    """Stops and joins the listener: nothing may ring it any more."""
    _built().doorbell_close(handle)


_pinned: list[int] = []  # the CPUs the pool's workers are pinned to (the pool is the process's)


def pin_workers(cpus: list[int]) -> None:
    """Pins the kernels' worker threads (ids 1..len(cpus)) to these CPUs, one each, now and when started;
    an empty list unpins them."""
    lib = _built()
    table = (ctypes.c_int32 * max(len(cpus), 1))(*cpus)
    lib.pool_pin(table, len(cpus))
    _pinned[:] = cpus


def pinned_cpus() -> list[int]:
    """The CPUs the workers are pinned to now; empty while they float."""
    return list(_pinned)


def simd_level() -> int:
    """The widest code path GLMFLASH_CPU_KERNELS allows (the kernel takes the widest the CPU has under it)."""
    return _LEVELS.get(_mode(), 3)


def simd_path() -> int:
    """The code path the kernels take on this CPU under GLMFLASH_CPU_KERNELS (0 portable .. 3 AVX-512 VNNI)."""
    lib = _built()
    return lib.simd_path(simd_level())


def take_paths_run() -> set[int]:
    """The code paths the kernels ran rows on since the last call (0 portable .. 3 AVX-512 VNNI), as cpu_gemv.c
    records them where it dispatches: what executed, for tests to check against what the CPU has."""
    ran = _built().take_paths_run()
    return {path for path in range(4) if ran >> path & 1}


@functools.lru_cache(maxsize=None)
def fp8_table() -> torch.Tensor:
    """Byte -> e4m3 value, from torch's own codec (NaN bytes never occur in a scale)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def gemv(x: torch.Tensor, weight: QuantWeight, threads: int) -> torch.Tensor:
    """x [R, K] on the CPU @ dequantize(weight [N, K])^T -> fp32 [R, N], without expanding the weight."""
    lib = _built()
    if len(weight.shape) != 2:
        raise ValueError(f"gemv: one matrix expected, got a weight of shape {weight.shape}")
    m, _keep = matrix(weight)
    xf = x.float().contiguous()
    if xf.dim() != 2 or xf.shape[1] != m.k:
        raise ValueError(f"gemv: x {tuple(x.shape)} against weight {weight.shape}")
    y = torch.empty(xf.shape[0], m.n, dtype=torch.float32)
    if lib.gemv(ctypes.byref(m), xf.data_ptr(), xf.shape[0], y.data_ptr(), fp8_table().data_ptr(), threads,
                simd_level()):
        raise ValueError(f"gemv: weight {weight.shape} {type(weight).__name__} has a shape the kernel cannot take "
                         "(NVFP4 needs K a multiple of 16; FP8 needs positive blocks)")
    return y


class ExpertStacks:
    """One layer's gate, up and down stacks as C views, for whole expert passes over host RAM."""

    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> None:
        views = [matrix(w) for w in (gate, up, down)]
        self.matrices = [m for m, _ in views]
        self._keep = [t for _, keep in views for t in keep]
        self.hidden, self.inter = gate.shape[-1], gate.shape[-2]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, starts: torch.Tensor, pair_weights: torch.Tensor,
                limit: float, threads: int, spin_ns: int = 0, firsts: torch.Tensor | None = None) -> torch.Tensor:
        """x [P, D]: one row per (token, expert) pair, grouped by expert (group g: rows starts[g]..starts[g+1]
        use experts[g]) -> [P, D] fp32, each row its expert's MLP output times its pair weight. firsts: group
        g runs only its expert's intermediate rows from firsts[g] on (the rest being the device's part of a
        split expert; None: every row). The threads stay awake `spin_ns` after the pass."""
        lib = _built()
        xf, w = x.float().contiguous(), pair_weights.float().contiguous()
        experts, starts = experts.to(torch.int64).contiguous(), starts.to(torch.int64).contiguous()
        firsts = firsts.to(torch.int64).contiguous() if firsts is not None else None
        pairs = xf.shape[0]
        out = torch.empty(pairs, self.hidden, dtype=torch.float32)
        workspace = torch.empty(pairs * (self.hidden + 3 * self.inter) + 1, dtype=torch.float32)
        gate, up, down = (ctypes.byref(m) for m in self.matrices)
        status = lib.experts_forward(gate, up, down, xf.data_ptr(), pairs, experts.numel(), experts.data_ptr(),
                                     starts.data_ptr(), firsts.data_ptr() if firsts is not None else None,
                                     w.data_ptr(), limit, out.data_ptr(), workspace.data_ptr(),
                                     fp8_table().data_ptr(), threads, simd_level(), spin_ns)
        if status:
            raise ValueError(f"experts_forward: stacks of shapes {[(m.n, m.k) for m in self.matrices]} do not "
                             "form an expert MLP the kernel can take, or a first row is not a multiple of the "
                             "down projection's block")
        return out
