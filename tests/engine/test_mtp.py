"""The MTP layer (the checkpoint's layer `num_layers`): loaded in every format that stores it (FP8-block in the
NVFP4 release too; the ModelOpt build has none and loads without it, saying so) and through the prepared
snapshot, and run: its logits against a reference built from transformers' own DSA attention and MoE modules
(transformers runs no MTP layer) with the spec's projection and norms around them, in float32 as the text
model's parity tests compare; the engine in
float32 and bf16, a prefill and a decode step over its own latent cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.cache import PagedLatents, RequestSlots
from engine.checkpoint.loader import has_mtp_layer, load_weights
from engine.checkpoint.prepared import below_layer, load_prepared, prepared_sizes, save_prepared
from engine.checkpoint.prepared_store import read_plan
from engine.config import ModelConfig
from engine.experts import default_executor
from engine.loading import prepared_problems
from engine.model.batch import DecodeMeta, ForwardBatch, SeqSpan
from engine.model.mtp import MtpLayer, with_mtp_cache
from engine.options import EngineOptions
from engine.weights import tensor_fields
from engine.tiny.factory import write_tiny_model
from tests.engine.conftest import dequantized_copy, load_reference, random_prompt
from tests.engine.test_bf16 import FACTOR, rel_error
from tests.engine.test_parity import assert_close

MTP = 8  # the tiny model's 8 decoder layers, then the MTP layer
DSA_LAYER = 3  # a decoder layer with DSA attention and a MoE block: the reference's modules are built as its
PROMPT_LEN = 60  # > index_topk + kpool - 1 = 35: the indexer drops positions
PAGE = 16


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    made: dict[tuple[str, bool], Path] = {}

    def make(fmt: str, well_conditioned: bool = False) -> Path:
        if (fmt, well_conditioned) not in made:
            made[fmt, well_conditioned] = write_tiny_model(tmp_path_factory.mktemp(f"mtp-{fmt}"), fmt,
                                                            well_conditioned=well_conditioned,
                                                            num_nextn_predict_layers=1)
        return made[fmt, well_conditioned]

    return make


def stored(snapshot: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(snapshot.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct"])
def test_the_mtp_layer_loads_as_stored(fmt, snapshots, tmp_path):
    snapshot = snapshots(fmt)
    cfg = ModelConfig.from_dir(snapshot)
    assert cfg.num_mtp_layers == 1
    weights = load_weights(snapshot, cfg, "cpu", torch.float32, mtp=True)
    plain = stored(dequantized_copy(snapshot, tmp_path / "plain"))
    prefix = f"model.language_model.layers.{MTP}."
    for name in ("eh_proj", "self_attn.q_b_proj", "self_attn.o_proj", "mlp.shared_experts.down_proj"):
        got = weights[f"layers.{MTP}.{name}"].dequantize(torch.float32)
        torch.testing.assert_close(got, plain[prefix + name + ".weight"].float(), rtol=0, atol=0)
    experts = weights[f"layers.{MTP}.mlp.experts.up_proj"].dequantize(torch.float32)
    torch.testing.assert_close(experts[5], plain[prefix + "mlp.experts.5.up_proj.weight"].float(), rtol=0, atol=0)
    assert torch.equal(weights[f"layers.{MTP}.enorm.weight"], plain[prefix + "enorm.weight"].float())
    if fmt != "bf16":  # FP8-block in both quantized releases
        assert type(weights[f"layers.{MTP}.self_attn.q_a_proj"]).__name__ == "Fp8BlockWeight"
    # Without asking, nothing of it is read; through the prepared snapshot, all of it comes back.
    assert not any(k.startswith(f"layers.{MTP}.") for k in load_weights(snapshot, cfg, "cpu", torch.float32))
    save_prepared(weights, tmp_path / "prepared")
    again, _ = load_prepared(tmp_path / "prepared", "cpu")
    assert torch.equal(again[f"layers.{MTP}.hnorm.weight"], weights[f"layers.{MTP}.hnorm.weight"])
    assert torch.equal(again[f"layers.{MTP}.mlp.experts.up_proj"].dequantize(torch.float32), experts)


def test_a_checkpoint_without_it_loads_and_says_so(snapshots, caplog):
    snapshot = snapshots("nvfp4-modelopt")  # the ModelOpt release stores no MTP layer, its config declares one
    cfg = ModelConfig.from_dir(snapshot)
    with caplog.at_level(logging.INFO, logger="glmflash.engine"):
        weights = load_weights(snapshot, cfg, "cpu", torch.float32, mtp=True)
    assert "event=mtp present=0" in caplog.text
    assert not any(k.startswith(f"layers.{MTP}.") for k in weights)


def test_a_prepared_snapshot_serves_a_start_with_or_without_drafts_as_its_layers_allow(snapshots, tmp_path):
    """With the MTP layer, a start without drafts reads the snapshot less that layer (its bytes out of the memory
    plan too); without it, a start that drafts is told to go cold, unless the checkpoint has none either."""
    snapshot, modelopt = snapshots("nvfp4-ct"), snapshots("nvfp4-modelopt")
    cfg = ModelConfig.from_dir(snapshot)
    assert has_mtp_layer(snapshot, cfg) and not has_mtp_layer(modelopt, ModelConfig.from_dir(modelopt))
    drafts, plain = EngineOptions(mtp_drafts=True), EngineOptions()
    for name, mtp in (("with", True), ("without", False)):
        save_prepared(load_weights(snapshot, cfg, "cpu", torch.float32, mtp=mtp), tmp_path / name)
    assert prepared_problems(tmp_path / "with", snapshot, drafts) == []
    assert prepared_problems(tmp_path / "with", snapshot, plain) == []
    assert prepared_problems(tmp_path / "without", snapshot, plain) == []
    assert prepared_problems(tmp_path / "without", snapshot, drafts, partial=True) == []  # early readiness: none
    assert prepared_problems(tmp_path / "without", modelopt, drafts) == []
    [problem] = prepared_problems(tmp_path / "without", snapshot, drafts)
    assert f"without the MTP layer (layer {MTP})" in problem

    meta = read_plan(tmp_path / "with").meta
    bounded = below_layer(meta, cfg.num_layers)
    assert set(bounded["weights"]) == {n for n in meta["weights"] if not n.startswith(f"layers.{MTP}.")}
    assert prepared_sizes(bounded) == prepared_sizes(read_plan(tmp_path / "without").meta)
    whole, _ = load_prepared(tmp_path / "with")
    less, stats = load_prepared(tmp_path / "with", layers=cfg.num_layers)
    assert set(less) == set(bounded["weights"]) and stats.bytes == prepared_sizes(bounded).total
    for name, weight in less.items():
        pairs = [(weight, whole[name])] if isinstance(weight, torch.Tensor) else \
            [(getattr(weight, f), getattr(whole[name], f)) for f in tensor_fields(weight)]
        assert all(torch.equal(a, b) for a, b in pairs), name


def test_a_partial_mtp_layer_is_refused_naming_the_tensor(snapshots, tmp_path):
    snapshot = snapshots("bf16")
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in snapshot.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = f"model.language_model.layers.{MTP}.hnorm.weight"
    shard = index["weight_map"].pop(gone)
    tensors = stored(broken)
    save_file({k: v for k, v in tensors.items() if index["weight_map"].get(k) == shard}, str(broken / shard),
              metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = ModelConfig.from_dir(broken)
    with pytest.raises(Exception, match="layers.8.hnorm.weight"):
        load_weights(broken, cfg, "cpu", torch.float32, mtp=True)


class Reference:
    """The MTP layer from transformers' modules in float32 (its MoE's grouped matmul takes no float64): its DSA attention and MoE are a decoder layer's
    (loaded with the MTP layer's tensors under that layer's names), the projection and norms are the spec's."""

    def __init__(self, snapshot: Path, tmp_path: Path, dtype: torch.dtype = torch.float32) -> None:
        plain = dequantized_copy(snapshot, tmp_path / "plain")
        tensors = stored(plain)
        mtp, host = f"model.language_model.layers.{MTP}.", f"model.language_model.layers.{DSA_LAYER}."
        renamed = {k: v for k, v in tensors.items() if not k.startswith(mtp)}
        for key, value in tensors.items():
            if key.startswith((mtp + "self_attn.", mtp + "mlp.")):
                renamed[host + key[len(mtp):]] = value
        save_file(renamed, str(plain / "model.safetensors"))
        model = load_reference(plain, torch.float32)
        layer = model.model.language_model.layers[DSA_LAYER]
        self.attn, self.moe = layer.self_attn.to(dtype), layer.mlp.to(dtype)
        self.w = {k[len(mtp):]: v.to(dtype) for k, v in tensors.items() if k.startswith(mtp)}
        self.embed = tensors["model.language_model.embed_tokens.weight"].to(dtype)
        self.lm_head = tensors["lm_head.weight"].to(dtype)
        self.eps, self.dtype = ModelConfig.from_dir(snapshot).rms_norm_eps, dtype

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * self.w[name]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        e = self.norm(self.embed[next_ids], "enorm.weight")
        z = torch.cat([e, self.norm(hidden.to(self.dtype), "hnorm.weight")], -1) @ self.w["eh_proj.weight"].T
        x = self.norm(z, "input_layernorm.weight")[None]
        z = z + self.attn(x, attention_mask=torch.ones(1, x.shape[1], dtype=torch.bool))[0][0]
        z = z + self.moe(self.norm(z, "post_attention_layernorm.weight")[None])[0]
        return (self.norm(z, "shared_head.norm.weight") @ self.lm_head.T).double()


Caches = tuple[RequestSlots, PagedLatents]  # with the MTP layer's DSA after the decoder layers


def engine_mtp(snapshot: Path, dtype: torch.dtype, device: str = "cpu") -> tuple[MtpLayer, Caches, ModelConfig]:
    cfg, dev = ModelConfig.from_dir(snapshot), torch.device(device)
    weights = load_weights(snapshot, cfg, dev, dtype, mtp=True)
    layer = MtpLayer(cfg, weights, MTP, default_executor(weights, [MTP], cfg.swiglu_limit, dev))
    pages = -(-(PROMPT_LEN + 8) // PAGE)
    held = with_mtp_cache(cfg)
    caches = RequestSlots(held, 2, dev, dtype), PagedLatents(held, pages, PAGE, dev, dtype)
    return layer, caches, cfg


def inputs(cfg: ModelConfig, seed: int) -> tuple[torch.Tensor, list[int]]:
    """A main-model hidden state per position (random, at the scale of the mHC streams' mean) and the tokens
    after each position."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(PROMPT_LEN, cfg.hidden_size, generator=g), random_prompt(PROMPT_LEN, seed)


def prefill(layer: MtpLayer, caches: Caches, hidden: torch.Tensor, next_ids: list[int],
            start: int = 0) -> torch.Tensor:
    pages, device = list(range(caches[1].num_pages)), caches[1].latents.device
    batch = ForwardBatch(torch.tensor(next_ids[start:], device=device),
                         [SeqSpan(0, len(next_ids) - start, start, 0, pages)])
    return layer.logits(layer(hidden[start:].to(device), batch, *caches)).cpu()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4-ct"])
def test_mtp_logits_match_the_reference(fmt, snapshots, tmp_path):
    snapshot = snapshots(fmt)
    layer, caches, cfg = engine_mtp(snapshot, torch.float32)
    hidden, next_ids = inputs(cfg, seed=1)
    ours = prefill(layer, caches, hidden, next_ids)
    assert ours.shape == (PROMPT_LEN, cfg.vocab_size)
    assert_close(ours, Reference(snapshot, tmp_path).logits(hidden, next_ids).float())


def test_a_decode_step_reads_the_prefills_latents(snapshots):
    layer, caches, cfg = engine_mtp(snapshots("bf16"), torch.float32)
    hidden, next_ids = inputs(cfg, seed=2)
    whole = prefill(layer, caches, hidden, next_ids)
    layer2, caches2, _ = engine_mtp(snapshots("bf16"), torch.float32)
    prefill(layer2, caches2, hidden[:-1], next_ids[:-1])
    pages = torch.arange(caches2[1].num_pages)[None]
    meta = DecodeMeta(torch.tensor([0]), torch.tensor([PROMPT_LEN - 1]), pages)
    last = layer2.logits(layer2(hidden[-1:], ForwardBatch(torch.tensor(next_ids[-1:]), [], meta), *caches2))
    torch.testing.assert_close(last[0], whole[-1], rtol=1e-4, atol=1e-4)


def test_bf16_loses_no_more_than_bf16_itself(snapshots, tmp_path):
    snapshot = snapshots("fp8", well_conditioned=True)
    layer, caches, cfg = engine_mtp(snapshot, torch.bfloat16)
    hidden, next_ids = inputs(cfg, seed=3)
    ours = prefill(layer, caches, hidden, next_ids).double()
    want = Reference(snapshot, tmp_path / "fp32").logits(hidden, next_ids)
    base = Reference(snapshot, tmp_path / "bf16", torch.bfloat16).logits(hidden, next_ids)
    assert rel_error(ours, want) <= FACTOR * rel_error(base, want), (rel_error(ours, want), rel_error(base, want))
