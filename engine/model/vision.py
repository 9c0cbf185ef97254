"""The vision tower: flat image patches -> one embedding per merged patch, in the text model's width.

A ViT over each image's patches (bidirectional attention within an image, 2D axial rotary positions, q/k
RMSNorm, clamped SwiGLU), then each merge_size x merge_size group of patches folded into one vector (a
strided convolution, i.e. a linear map of the group) and projected by a clamped SwiGLU merger. The patch
embedding is a 3D convolution whose stride is its kernel, so it is a linear map of each flat patch too:
every matrix here runs as a plain linear. Weights are the checkpoint's `model.visual.*` tensors (BF16 in every
release), keys relative to that prefix.

Images are independent: a batch of them is packed along the patch axis and attention runs per image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import VisionConfig

PREFIXES = ("model.visual.", "visual.")


def vision_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tower's tensors out of a checkpoint's (`model.visual.*`) or the loader's (`visual.*`), keyed without it."""
    found = {}
    for key, tensor in tensors.items():
        for prefix in PREFIXES:
            if key.startswith(prefix):
                found[key[len(prefix):]] = tensor
    return found


def patch_positions(grids: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """(row, column) of every patch [N, 2], in the processor's merge order (each merge x merge group of patches
    consecutive), frames one after another."""
    out = []
    for frames, height, width in grids:
        shape = (height // merge, merge, width // merge, merge)  # merged row, row in it, merged column, column in it
        rows = torch.arange(height, device=device).view(shape[0], merge, 1, 1).expand(shape)
        cols = torch.arange(width, device=device).view(1, 1, shape[2], merge).expand(shape)
        pairs = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        out.append(pairs.repeat(frames, 1))
    return torch.cat(out)


def rotary(positions: torch.Tensor, config: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] (fp32): a quarter of the head's frequencies for the row, a quarter for the column,
    the two halves of the head rotated alike."""
    quarter = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=positions.device)
                                            / quarter))
    angles = positions.float()[..., None] * inv_freq  # [N, 2, head_dim / 4]
    half = torch.cat([angles[:, 0], angles[:, 1]], dim=-1)
    full = torch.cat([half, half], dim=-1)
    return full.cos(), full.sin()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def _swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, limit: float) -> torch.Tensor:
    gate = F.linear(x, w[f"{prefix}gate_proj.weight"], w.get(f"{prefix}gate_proj.bias")).clamp(max=limit)
    up = F.linear(x, w[f"{prefix}up_proj.weight"], w.get(f"{prefix}up_proj.bias")).clamp(-limit, limit)
    return F.linear(F.silu(gate) * up, w[f"{prefix}down_proj.weight"], w.get(f"{prefix}down_proj.bias"))


class VisionTower:
    """The tower's forward over `vision_weights(...)` tensors (on the device, in the serving dtype)."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config, self.w = config, weights
        missing = [k for k in self.expected_keys() if k not in weights]
        if missing:
            raise ValueError(f"vision tower: missing tensors {', '.join('model.visual.' + k for k in missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        # The 3D patch convolution and the 2D merge convolution as matrices over their flattened inputs.
        self.patch_matrix = weights["patch_embed.proj.weight"].flatten(1)
        self.merge_matrix = weights["downsample.weight"].flatten(1)

    def expected_keys(self) -> list[str]:
        block = ["norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                 "attn.proj.bias", "attn.q_norm.weight", "attn.k_norm.weight"] + \
                [f"mlp.{p}_proj.{t}" for p in ("gate", "up", "down") for t in ("weight", "bias")]
        merger = ["merger.proj.weight", "merger.post_projection_norm.weight", "merger.post_projection_norm.bias",
                  "merger.gate_proj.weight", "merger.up_proj.weight", "merger.down_proj.weight"]
        return (["patch_embed.proj.weight", "patch_embed.proj.bias", "post_layernorm.weight", "downsample.weight",
                 "downsample.bias"] + merger + [f"blocks.{i}.{k}" for i in range(self.config.depth) for k in block])

    def __call__(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [N, C * T * P * P] (the processor's patches, images packed) -> [N / merge^2, out_hidden]."""
        cfg, w = self.config, self.w
        dtype = self.patch_matrix.dtype
        x = F.linear(pixel_values.to(dtype), self.patch_matrix, w["patch_embed.proj.bias"])
        cos, sin = rotary(patch_positions(grids, cfg.spatial_merge_size, x.device), cfg)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        lengths = [t * h * wd for t, h, wd in grids]
        for i in range(cfg.depth):
            x = x + self._attention(_rms_norm(x, w[f"blocks.{i}.norm1.weight"], cfg.rms_norm_eps), i, cos, sin, lengths)
            x = x + _swiglu(_rms_norm(x, w[f"blocks.{i}.norm2.weight"], cfg.rms_norm_eps), w, f"blocks.{i}.mlp.",
                            cfg.swiglu_limit)
        x = _rms_norm(x, w["post_layernorm.weight"], cfg.rms_norm_eps)
        merge = cfg.spatial_merge_size
        # Each group of merge x merge consecutive patches, as the convolution reads it: channel, row, column.
        groups = x.view(-1, merge, merge, cfg.hidden_size).permute(0, 3, 1, 2).flatten(1)
        x = F.linear(groups, self.merge_matrix, w["downsample.bias"])
        x = F.linear(x, w["merger.proj.weight"])
        x = F.gelu(F.layer_norm(x, (x.shape[-1],), w["merger.post_projection_norm.weight"],
                                w["merger.post_projection_norm.bias"], 1e-5))
        return _swiglu(x, w, "merger.", cfg.swiglu_limit)

    def _attention(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor,
                   lengths: list[int]) -> torch.Tensor:
        cfg, w = self.config, self.w
        qkv = F.linear(x, w[f"blocks.{i}.attn.qkv.weight"], w[f"blocks.{i}.attn.qkv.bias"])
        q, k, v = qkv.view(x.shape[0], 3, cfg.num_heads, cfg.head_dim).unbind(1)
        q = _rotate(_rms_norm(q, w[f"blocks.{i}.attn.q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        k = _rotate(_rms_norm(k, w[f"blocks.{i}.attn.k_norm.weight"], cfg.rms_norm_eps), cos, sin)
        # [1, heads, patches, head_dim]: the fused (flash, memory-efficient) kernels take 4D inputs only.
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi)))[0]
                .transpose(0, 1) for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return F.linear(torch.cat(outs).reshape(x.shape[0], cfg.hidden_size), w[f"blocks.{i}.attn.proj.weight"],
                        w[f"blocks.{i}.attn.proj.bias"])
