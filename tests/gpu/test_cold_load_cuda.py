"""The cold start's one pass on CUDA: shards read through pinned staging straight into GPU memory (experts
into pinned host stacks under a budget), the prepared snapshot written back from GPU memory through pinned
staging; every byte equals the CPU load's; a fast resume's host memory is its host bank and staging (runs only
where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.layout import is_expert_stack
from engine.checkpoint.loader import load_weights
from engine.checkpoint.prepared import load_prepared, save_prepared
from engine.config import ModelConfig
from engine.tiny.factory import write_tiny_model
from engine.weights import SplitStack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]


def _buffers(weight) -> list[torch.Tensor]:
    return [weight] if isinstance(weight, torch.Tensor) else [v for v in vars(weight).values()
                                                              if isinstance(v, torch.Tensor)]


def _stored(weight) -> list[torch.Tensor]:
    """A weight's buffers as host bytes, a split stack's device slots and hosted experts joined in order."""
    if isinstance(weight, SplitStack):
        return [torch.cat([d.cpu().view(torch.uint8), h.view(torch.uint8)])
                for d, h in zip(_buffers(weight.device), _buffers(weight.hosted))]
    return [t.cpu().view(torch.uint8) for t in _buffers(weight)]


def _dtypes(weight) -> list[torch.dtype]:
    return [t.dtype for t in _buffers(weight.device if isinstance(weight, SplitStack) else weight)]


@pytest.mark.parametrize("fmt,slots", [("nvfp4-ct", None), ("nvfp4-ct", 2), ("fp8", None), ("bf16", 2)])
def test_cold_pass_to_cuda_and_prepared_written_from_it(tmp_path, monkeypatch, fmt, slots):
    import engine.checkpoint.prepared_store as store
    import engine.checkpoint.shards as shards

    monkeypatch.setattr(shards, "CHUNK_BYTES", 64 << 10)  # many chunks, straddling weights, own-buffer tensors
    monkeypatch.setattr(shards, "STAGING_BYTES", 96 << 10)
    monkeypatch.setattr(store, "PIECE_BYTES", 32 << 10)  # many pieces through the writer's staging buffers
    snapshot = write_tiny_model(tmp_path / fmt, fmt)
    cfg = ModelConfig.from_dir(snapshot)
    truth = load_weights(snapshot, cfg, "cpu", torch.bfloat16)
    on_gpu = load_weights(snapshot, cfg, "cuda", torch.bfloat16, slots, workers=4)
    for name, weight in on_gpu.items():
        if isinstance(weight, SplitStack):
            assert {t.device.type for t in _buffers(weight.device)} == {"cuda"}, name
            assert all(t.is_pinned() for t in _buffers(weight.host)), name
        else:
            assert {t.device.type for t in _buffers(weight)} == {"cuda"}, name
    assert any(isinstance(w, SplitStack) for w in on_gpu.values()) == (slots is not None)
    save_prepared(on_gpu, tmp_path / "prepared", workers=3)
    back, _ = load_prepared(tmp_path / "prepared", "cuda", workers=3, expert_slots=slots)
    for loaded in (on_gpu, back):
        assert loaded.keys() == truth.keys()
        for name, weight in truth.items():
            assert _dtypes(loaded[name]) == _dtypes(weight), name
            for a, b in zip(_stored(loaded[name]), _buffers(weight), strict=True):
                assert torch.equal(a, b.view(torch.uint8)), name


def test_a_fast_resume_holds_the_host_bank_and_its_staging_on_the_host(tmp_path):
    """From a prepared snapshot on CUDA, the host's memory grows by the host bank (pinned, spares included)
    and the readers' pinned staging buffers, and nothing else of the size of a weight: the non-expert weights
    and the slots go through staging to the GPU."""
    from engine.checkpoint.prepared_store import PIECE_BYTES
    from tests.engine.checkpoint.test_prepared import load_memory

    figures = load_memory(tmp_path, "cuda")
    grown, bank = figures["peak"] - figures["before"], figures["host_bank"]
    assert bank > 200e6
    assert 0.9 * bank <= grown <= bank + 2 * PIECE_BYTES + (128 << 20), figures  # 2 readers' staging
