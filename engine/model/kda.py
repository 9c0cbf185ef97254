"""KDA mixer (34 of the 45 layers): projections, short convs, lower-bound forget gate, delta rule, gated norm."""

from __future__ import annotations

import torch

from engine.cache import RequestSlots
from engine.config import ModelConfig
from engine.kernels import kernel
from engine.model.batch import ForwardBatch
from engine.model.layers import linear


class KdaMixer:
    def __init__(self, cfg: ModelConfig, w: dict, prefix: str, state_index: int) -> None:
        self.cfg, self.state_index = cfg, state_index
        p = prefix + "self_attn."
        self.q, self.k, self.v = w[p + "q_proj"], w[p + "k_proj"], w[p + "v_proj"]
        # The three depthwise convs are independent channels; one [3P, k] kernel runs them together.
        self.conv = torch.cat([w[p + f"{x}_conv1d.weight"].squeeze(1) for x in "qkv"]).contiguous()
        self.f_a, self.f_b, self.g_a, self.g_b = w[p + "f_a_proj"], w[p + "f_b_proj"], w[p + "g_a_proj"], w[p + "g_b_proj"]
        self.b = w[p + "b_proj"]
        self.decay_rate = w[p + "A_log"].float().exp()
        self.dt_bias = w[p + "dt_bias"]
        self.o_norm, self.o = w[p + "o_norm.weight"], w[p + "o_proj"]

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, slots: RequestSlots) -> torch.Tensor:
        cfg, dev = self.cfg, x.device.type
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        qkv = torch.cat([linear(x, self.q), linear(x, self.k), linear(x, self.v)], dim=-1)
        gate = linear(linear(x, self.f_a), self.f_b).float() + self.dt_bias
        g = cfg.gate_lower_bound * torch.sigmoid(self.decay_rate.view(h, 1) * gate.view(-1, h, d))
        beta = torch.sigmoid(linear(x, self.b))
        out = torch.empty(x.shape[0], h, d, dtype=x.dtype, device=x.device)
        rec, conv = slots.recurrent[self.state_index], slots.conv[self.state_index]

        single = batch.single_token
        if single:
            rows = torch.tensor([batch.spans[i].offset for i in single], device=x.device)
            idx = torch.tensor([batch.spans[i].slot for i in single], device=x.device)
            mixed, conv[idx] = kernel("short_conv", dev)(qkv[rows].unsqueeze(1), conv[idx], self.conv)
            q, k, v = mixed.squeeze(1).view(len(single), 3, h, d).unbind(1)
            out[rows], rec[idx] = kernel("kda_step", dev)(q, k, v, g[rows], beta[rows], rec[idx])
        for i in batch.multi_token:
            span = batch.spans[i]
            sl, s = span.rows, span.slot
            mixed, new_conv = kernel("short_conv", dev)(qkv[sl].unsqueeze(0), conv[s:s + 1], self.conv)
            conv[s] = new_conv[0]
            q, k, v = mixed[0].view(span.new, 3, h, d).unbind(1)
            out[sl], rec[s] = kernel("kda_chunk", dev)(q, k, v, g[sl], beta[sl], rec[s])

        gate_out = linear(linear(x, self.g_a), self.g_b).view(-1, h, d)
        of = out.float()
        normed = self.o_norm.float() * (of * torch.rsqrt(of.square().mean(-1, keepdim=True) + cfg.rms_norm_eps))
        o = (normed * torch.sigmoid(gate_out.float())).to(x.dtype)
        return linear(o.reshape(x.shape[0], -1), self.o)
