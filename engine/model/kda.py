"""KDA mixer (34 of the 45 layers): projections, short convs, lower-bound forget gate, delta rule, gated norm."""

from __future__ import annotations

import torch

from engine.cache import RequestSlots
from engine.config import ModelConfig
from engine.kernels import kernel
from engine.kernels.kda.torch_ref import ConvRows
from engine.model.batch import DecodeMeta, ForwardBatch
from engine.model.layers import FusedLinear, linear


class KdaMixer:
    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, state_index: int) -> None:
        self.cfg, self.state_index = cfg, state_index
        p = prefix + "self_attn."
        # Every projection of x in one matmul: (q|k|v), the two low-rank gate inputs, beta.
        self.inputs = FusedLinear(w, (p + "q_proj", p + "k_proj", p + "v_proj"), p + "f_a_proj", p + "g_a_proj",
                                  p + "b_proj")
        # The three depthwise convs are independent channels; one [3P, k] kernel runs them together.
        self.conv = torch.cat([w[p + f"{x}_conv1d.weight"].squeeze(1) for x in "qkv"]).contiguous()
        self.f_b, self.g_b = w[p + "f_b_proj"], w[p + "g_b_proj"]
        self.decay_rate = w[p + "A_log"].float().exp()
        self.dt_bias = w[p + "dt_bias"]
        self.o_norm, self.o = w[p + "o_norm.weight"], w[p + "o_proj"]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, slots: RequestSlots) -> torch.Tensor:
        qkv, forget_low, gate_low, beta_logits = self.inputs(x)
        rec, conv = slots.recurrent[self.state_index], slots.conv[self.state_index]
        meta = batch.decode
        if meta is not None and meta.per_request == 1:  # the gates' up-projections inside the decode op
            return linear(self._decode(qkv, forget_low, beta_logits, gate_low, rec, conv, meta.slots), self.o)
        if meta is not None:  # a verify: every request's tokens and drafts, as equal spans of static shape
            o = self._spans(qkv, forget_low, beta_logits, gate_low, rec, conv, meta.request_slots,
                            *batch.layout(("verify", self.conv.shape[-1]), lambda: _equal_spans(meta, self.conv)),
                            meta.per_request)
            return linear(o, self.o)
        o = torch.empty(x.shape[0], self.cfg.linear_dim, dtype=x.dtype, device=x.device)
        if batch.multi_token_spans:  # first: a prompt's last token may be a one-token row of this step
            o[batch.prefill_layout[0]] = self._prefill(qkv, forget_low, beta_logits, gate_low, rec, conv, batch)
        if batch.snapshot_saves is not None:
            batch.snapshot_saves.save_kda(rec, conv, self.state_index)
        if batch.one_token_spans:  # decoding requests in a mixed step: the fused step of a pure decode batch
            rows = batch.one_token_rows
            o[rows] = self._decode(qkv[rows], forget_low[rows], beta_logits[rows], gate_low[rows], rec, conv,
                                   batch.one_token.slots)
        return linear(o, self.o)

    def _decode(self, qkv: torch.Tensor, forget_low: torch.Tensor, beta_logits: torch.Tensor,
                gate_low: torch.Tensor, rec: torch.Tensor, conv: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """One token per request: the gates' up-projections, conv, gates, delta-rule step and gated output norm in
        one op."""
        cfg = self.cfg
        return kernel("kda_decode", qkv.device.type)(
            qkv, forget_low, self.f_b, beta_logits, gate_low, self.g_b, conv, self.conv, rec, slot_ids,
            self.decay_rate, self.dt_bias, self.o_norm, cfg.gate_lower_bound, cfg.rms_norm_eps)

    def _prefill(self, qkv: torch.Tensor, forget_low: torch.Tensor, beta_logits: torch.Tensor,
                 gate_low: torch.Tensor, rec: torch.Tensor, conv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every multi-token span at once: conv, gates, delta rule and gated norm in one op over the ragged batch."""
        rows, slot_ids, cu_seqlens = batch.prefill_layout
        history = self.conv.shape[-1] - 1
        lengths = [batch.spans[i].new for i in batch.multi_token_spans]
        layout = batch.layout((ConvRows, history), lambda: ConvRows.of(lengths, history, qkv.device))
        return self._spans(qkv[rows], forget_low[rows], beta_logits[rows], gate_low[rows], rec, conv, slot_ids,
                           cu_seqlens, layout, max(lengths))

    def _spans(self, qkv: torch.Tensor, forget_low: torch.Tensor, beta_logits: torch.Tensor, gate_low: torch.Tensor,
               rec: torch.Tensor, conv: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
               conv_rows: ConvRows, longest: int) -> torch.Tensor:
        """Multi-token spans: the gates up-projected for their rows only (a mixed step's decoding rows take theirs
        inside the decode op), then the spans op."""
        cfg = self.cfg
        forget, gate_out = linear(forget_low, self.f_b), linear(gate_low, self.g_b)
        return kernel("kda_spans", qkv.device.type)(
            qkv, forget, beta_logits, gate_out, conv, self.conv, rec, slot_ids, cu_seqlens, conv_rows, longest,
            self.decay_rate, self.dt_bias, self.o_norm, cfg.gate_lower_bound, cfg.rms_norm_eps)


def _equal_spans(meta: DecodeMeta, conv_weight: torch.Tensor) -> tuple[torch.Tensor, ConvRows]:
    """(cu_seqlens, conv rows) of B spans of `per_request` tokens: shapes only, so a captured verify reuses them."""
    n, device = meta.per_request, meta.slots.device
    requests = meta.slots.shape[0] // n
    return (torch.arange(0, (requests + 1) * n, n, device=device),
            ConvRows.of([n] * requests, conv_weight.shape[-1] - 1, device))
