"""The CUDA driver calls a hybrid decode step needs and torch does not expose.

A host function queued in a stream runs on the driver's own thread once the work before it is done,
and stream capture records it as a graph node: that is what lets a decode step whose misses run on
the CPU stay one CUDA graph. Stream memory operations (a 32-bit write to, and a wait on, device-mapped
pinned memory) are captured the same way and ring a listener thread instead (offload/doorbell.py),
without the driver's thread in between. Copies between pinned host buffers and the device go through
the driver as well, so nothing of torch's pinned-memory bookkeeping (events it records and later
queries) runs inside a capture.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemcpyAsync.restype = ctypes.c_int
    for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):  # the memory operations every GPU has
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            getattr(lib, name).restype = ctypes.c_int
    return lib


WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


def memory_operations_available() -> bool:
    """Whether this driver has the stream memory operations (CUDA 11.7 and later)."""
    lib = _driver()
    return hasattr(lib, "cuStreamWriteValue32_v2") and hasattr(lib, "cuStreamWaitValue32_v2")


def _check(status: int, call: str) -> None:
    if status:
        raise RuntimeError(f"{call} failed with CUresult {status}")


def launch_host_func(stream: torch.cuda.Stream, function: int, argument: int) -> None:
    """Queue `function(argument)` (a C function address, a pointer) on `stream`."""
    _check(_driver().cuLaunchHostFunc(stream.cuda_stream, function, argument), "cuLaunchHostFunc")


def write_value(stream: torch.cuda.Stream, word: int, value: int) -> None:
    """Queue `*word = value` (32 bits, device-mapped memory) on `stream`, after a fence: whatever the stream
    wrote before it is visible first."""
    _check(_driver().cuStreamWriteValue32_v2(stream.cuda_stream, word, value, 0), "cuStreamWriteValue32")


def wait_value(stream: torch.cuda.Stream, word: int, value: int) -> None:
    """Queue on `stream` a wait until `*word == value` (32 bits, device-mapped memory)."""
    _check(_driver().cuStreamWaitValue32_v2(stream.cuda_stream, word, value, WAIT_VALUE_EQ), "cuStreamWaitValue32")


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """dst <- src on `stream`: contiguous tensors of the same bytes, pinned host and device either way."""
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.nbytes != src.nbytes or dst.dtype != src.dtype:
        raise ValueError(f"copy_async: {src.dtype} {tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)}")
    _check(_driver().cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes, stream.cuda_stream), "cuMemcpyAsync")
