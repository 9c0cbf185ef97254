"""Images to the vision tower's input: decoded with Pillow, fitted to a patch grid within a token budget,
normalized and cut into flat patches, as the checkpoint's image processor does (transformers'
`Glm5NextImageProcessor`, the test oracle).

The rule: the image's canvas is its size rounded up to whole merged patches (`patch_size * merge_size`
pixels), scaled up to at least `min_image_tokens` merged patches and, above `max_image_tokens`, shrunk to the
tallest canvas of the image's aspect that fits. The image is resized into that canvas without upscaling
(unless it is below the minimum), its aspect kept, and the rest of the canvas padded with black at the bottom
and right before normalization. Each patch is repeated `temporal_patch_size` times: the tower's patch embedding
is a 3D convolution made for video, a still image is two identical frames.

Decoding is where untrusted bytes meet the engine: formats outside PNG, JPEG, WebP and GIF (its first frame),
bytes or pixels over the limits and undecodable data raise `ImageError` with what was wrong, before any pixel
is decoded where the header already tells.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# CLIP's normalization, the checkpoint's image processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image the server cannot take: the message says why (shown to the client)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings: `preprocessor_config.json`'s fields, transformers' defaults where absent,
    and the limits on what a request may send."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    max_bytes: int = 20 << 20  # an encoded image
    max_pixels: int = 50_000_000  # a decoded image (width x height), checked from the header before decoding

    @property
    def factor(self) -> int:
        """A merged patch's side in pixels: the canvas is a whole number of them."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_snapshot(cls, snapshot: str | Path, **limits: int) -> "ImageProcessorConfig":
        """The snapshot's `preprocessor_config.json` where it has one (fields it lacks keep the defaults)."""
        path = Path(snapshot) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.exists() else {}
        names = ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens", "max_image_tokens")
        fields: dict = {name: int(raw[name]) for name in names if name in raw}
        for name in ("image_mean", "image_std"):
            if name in raw:
                fields[name] = tuple(float(v) for v in raw[name])
        return cls(**fields, **limits)


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the tower takes it: flat patches [grid_h * grid_w, 3 * T * P * P] (float32) in merge
    order (each merge_size x merge_size group of patches consecutive), and its grid."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge_size: int
    digest: bytes  # of the fitted canvas's pixels: equal images (after fitting) share it, others do not

    @property
    def num_tokens(self) -> int:
        """Image tokens the prompt holds for it: one per merged patch."""
        _, grid_h, grid_w = self.grid_thw
        return grid_h * grid_w // self.merge_size ** 2


def decode_image(data: bytes, config: ImageProcessorConfig) -> Image.Image:
    """Encoded bytes -> an RGB image, transparency composited on white; GIF's first frame."""
    if len(data) > config.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over the limit of {config.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"cannot decode image: not one of {', '.join(FORMATS)}") from None
    except Image.DecompressionBombError as error:  # Pillow's own pixel ceiling, where it is below ours
        raise ImageError(f"image is over the pixel limit: {error}") from None
    except (OSError, ValueError, SyntaxError) as error:  # a header cut short
        raise ImageError(f"cannot decode image: {error}") from None
    width, height = image.size
    if width * height > config.max_pixels:
        raise ImageError(f"image is {width}x{height} pixels, over the limit of {config.max_pixels} pixels")
    try:
        image.load()  # the first frame of an animation: the one a still image is taken from
        return to_rgb(image)
    except (OSError, ValueError, SyntaxError) as error:  # truncated or corrupt data, Pillow's own words
        raise ImageError(f"cannot decode {image.format} image: {error}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band or a palette's transparent index) composited on white: what
    the checkpoint's processor does, so the tower sees the same pixels."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def canvas_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) of the padded canvas: whole merged patches, within [min, max] image tokens."""
    factor, frames = config.factor, config.temporal_patch_size
    unit = frames * factor ** 2  # canvas pixels (over the frames) per image token
    low_budget, high_budget = config.min_image_tokens * unit, config.max_image_tokens * unit
    if high_budget < frames * factor ** 2:
        raise ValueError(f"max_image_tokens={config.max_image_tokens} leaves no room for one merged patch")

    def up(value: float) -> int:
        return math.ceil(value / factor) * factor

    canvas_h, canvas_w = up(height), up(width)
    if frames * canvas_h * canvas_w < low_budget:  # too small: scaled up to the minimum
        scale = math.sqrt(low_budget / (frames * height * width))
        canvas_h, canvas_w = up(max(1, math.ceil(height * scale))), up(max(1, math.ceil(width * scale)))
    if frames * canvas_h * canvas_w <= high_budget:
        return canvas_h, canvas_w
    # Too large: the tallest content height (the width following the aspect) whose canvas fits.
    best, lo, hi = (factor, factor), 1, height
    while lo <= hi:
        content_h = (lo + hi) // 2
        candidate = up(content_h), up(max(1, math.floor(width * content_h / height)))
        if frames * candidate[0] * candidate[1] <= high_budget:
            best, lo = candidate, content_h + 1
        else:
            hi = content_h - 1
    return best


def fit_to_canvas(image: Image.Image, config: ImageProcessorConfig) -> torch.Tensor:
    """The image resized into its canvas (aspect kept, bicubic on 8-bit pixels, never upscaled unless below the
    minimum) and padded with black: uint8 [3, H, W]."""
    width, height = image.size
    canvas_h, canvas_w = canvas_size(height, width, config)
    scale = min(canvas_h / height, canvas_w / width)
    unit = config.temporal_patch_size * config.factor ** 2
    if config.temporal_patch_size * height * width >= unit * config.min_image_tokens:
        scale = min(1.0, scale)
    content_h = max(1, min(canvas_h, math.floor(height * scale)))
    content_w = max(1, min(canvas_w, math.floor(width * scale)))
    if (content_h, content_w) != (height, width):
        image = image.resize((content_w, content_h), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(content_h, content_w, 3)
    canvas = torch.zeros(3, canvas_h, canvas_w, dtype=torch.uint8)
    canvas[:, :content_h, :content_w] = pixels.permute(2, 0, 1)
    return canvas


def normalize(canvas: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """uint8 [3, H, W] -> float32, scaled to [0, 1] in float64 then normalized in float32 (the processor's
    order of roundings: the same bits). A byte has 256 values, so each channel's results are a table looked up
    per pixel: the arithmetic on 256 values instead of millions."""
    levels = (torch.arange(256, dtype=torch.float64) * (1 / 255)).float()
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1)
    table = (levels - mean) / std  # [3, 256]
    return torch.stack([table[channel][canvas[channel].long()] for channel in range(3)])


def patchify(image: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """[3, H, W] -> [grid_h * grid_w, 3 * T * P * P]: patches in merge order, each repeated over T frames."""
    patch, merge, frames = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = image.shape
    grid_h, grid_w = height // patch, width // patch
    blocks = image.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # merged row, merged column, row in it, column in it, C, P, P
    blocks = blocks.unsqueeze(5).expand(*blocks.shape[:5], frames, patch, patch)
    return blocks.reshape(grid_h * grid_w, channels * frames * patch * patch)


def preprocess(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """An RGB image (`decode_image`'s) -> the tower's input."""
    canvas = fit_to_canvas(image, config)
    pixels = normalize(canvas, config)
    grid = (1, pixels.shape[1] // config.patch_size, pixels.shape[2] // config.patch_size)
    digest = hashlib.blake2b(canvas.numpy().tobytes(), digest_size=16, person=b"glmflash-image")
    digest.update(repr((grid, config.image_mean, config.image_std)).encode())
    return ProcessedImage(patchify(pixels, config), grid, config.merge_size, digest.digest())


def image_tokens(height: int, width: int, config: ImageProcessorConfig) -> int:
    """Image tokens an image of this size takes, without decoding it (the context check before the work)."""
    canvas_h, canvas_w = canvas_size(height, width, config)
    return (canvas_h // config.factor) * (canvas_w // config.factor)
