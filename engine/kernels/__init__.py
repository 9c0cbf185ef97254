"""Hot ops behind dispatch points; importing this package registers every implementation."""

from engine.kernels import dispatch
from engine.kernels.experts import gather as _gather  # noqa: F401
from engine.kernels.experts import hybrid_pairs as _hybrid_pairs  # noqa: F401
from engine.kernels.experts import pcie_pick as _pcie_pick  # noqa: F401
from engine.kernels.indexer import torch_ref as _indexer  # noqa: F401
from engine.kernels.indexer import triton_indexer as _indexer_triton  # noqa: F401
from engine.kernels.kda import fla_prefill as _kda_prefill  # noqa: F401
from engine.kernels.kda import torch_ref as _kda  # noqa: F401
from engine.kernels.kda import triton_conv as _kda_conv  # noqa: F401
from engine.kernels.kda import triton_decode as _kda_decode  # noqa: F401
from engine.kernels.kda import triton_gates as _kda_gates  # noqa: F401
from engine.kernels.kda import triton_spans as _kda_spans  # noqa: F401
from engine.kernels.linear import torch_ref as _linear  # noqa: F401
from engine.kernels.linear import triton_linear as _linear_triton  # noqa: F401
from engine.kernels.mhc import torch_ref as _mhc  # noqa: F401
from engine.kernels.mhc import triton_kernels as _mhc_triton  # noqa: F401
from engine.kernels.norm import torch_ref as _norm  # noqa: F401
from engine.kernels.norm import triton_norm as _norm_triton  # noqa: F401
from engine.kernels.router import torch_ref as _router  # noqa: F401
from engine.kernels.router import triton_router as _router_triton  # noqa: F401
from engine.kernels.sparse_mla import torch_ref as _sparse_mla  # noqa: F401
from engine.kernels.sparse_mla import triton_sparse_mla as _sparse_mla_triton  # noqa: F401
from engine.kernels.swiglu import torch_ref as _swiglu  # noqa: F401
from engine.kernels.swiglu import triton_swiglu as _swiglu_triton  # noqa: F401

kernel = dispatch.kernel
__all__ = ["kernel"]
