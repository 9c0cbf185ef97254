"""Image preprocessing against transformers' `Glm5NextImageProcessorPil`: the same patches bit for bit and the
same grids, over odd sizes and aspects (below the token minimum, above the maximum), every mode a client sends
(RGB, RGBA, grayscale, palette with and without a transparent index) and every accepted format; bad images are
refused with what was wrong."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers.models.glm5_next import image_processing_pil_glm5_next as transformers_processor

from engine.vision.preprocess import ImageError, ImageProcessorConfig, decode_image, image_tokens, preprocess, to_rgb


CONFIG = ImageProcessorConfig()
# (width, height): below the minimum budget, tiny, extreme aspects, the usual sizes, above the maximum budget.
SIZES = [(5, 7), (1, 1), (30, 500), (500, 30), (448, 448), (333, 251), (1920, 1080), (13, 1000), (3000, 2400)]


def noise_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """A noisy image (resampling differences show on noise, not on flat colour) in `mode`."""
    generator = torch.Generator().manual_seed(seed)
    bands = torch.randint(0, 256, (height, width, 4), dtype=torch.uint8, generator=generator)
    rgba = Image.frombytes("RGBA", (width, height), bands.numpy().tobytes())
    if mode == "RGBA":
        return rgba
    if mode == "P":
        return rgba.convert("RGB").quantize(64)
    return rgba.convert(mode)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def assert_matches_transformers(data: bytes) -> None:
    ours = preprocess(decode_image(data, CONFIG), CONFIG)
    reference = transformers_processor.Glm5NextImageProcessorPil()(Image.open(io.BytesIO(data)), return_tensors="pt")
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32
    assert torch.equal(ours.pixel_values, reference["pixel_values"])
    _, grid_h, grid_w = ours.grid_thw
    assert ours.num_tokens == grid_h * grid_w // 4
    width, height = Image.open(io.BytesIO(data)).size
    assert image_tokens(height, width, CONFIG) == ours.num_tokens


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sizes_match_transformers(size):
    fmt = "JPEG" if size[0] * size[1] > 4_000_000 else "PNG"  # noise as PNG would pass the byte limit
    assert_matches_transformers(encode(noise_image(*size, "RGB", seed=size[0] * 7 + size[1]), fmt))


# JPEG stores no alpha and no palette: a client's encoder converts those first.
MODES_AND_FORMATS = [(mode, fmt) for fmt in ("PNG", "JPEG", "WEBP", "GIF") for mode in ("RGB", "RGBA", "L", "LA", "P")
                     if not (fmt == "JPEG" and mode in ("RGBA", "LA", "P"))]


@pytest.mark.parametrize("mode, fmt", MODES_AND_FORMATS)
def test_modes_and_formats_match_transformers(mode, fmt):
    image = noise_image(97, 61, mode, seed=3)
    if fmt == "GIF" and mode != "P":
        image = image.convert("P")  # GIF stores palettes
    assert_matches_transformers(encode(image, fmt))


def test_palette_transparency_is_composited_on_white():
    image = noise_image(64, 40, "P", seed=4)
    data = encode(image, "PNG", transparency=0)  # palette index 0 transparent
    assert_matches_transformers(data)
    decoded = decode_image(data, CONFIG)
    mask = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(40, 64) == 0
    pixels = torch.frombuffer(bytearray(decoded.tobytes()), dtype=torch.uint8).view(40, 64, 3)
    assert mask.any() and bool((pixels[mask] == 255).all())


def test_an_animated_gif_gives_its_first_frame():
    frames = [noise_image(50, 30, "P", seed=s) for s in (5, 6)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    data = buffer.getvalue()
    assert_matches_transformers(data)
    first = encode(frames[0], "GIF")
    assert torch.equal(preprocess(decode_image(data, CONFIG), CONFIG).pixel_values,
                       preprocess(decode_image(first, CONFIG), CONFIG).pixel_values)


def test_a_1080p_screenshot_is_thousands_of_patches_within_the_budget():
    processed = preprocess(decode_image(encode(noise_image(1920, 1080, "RGB", seed=8), "PNG"), CONFIG), CONFIG)
    assert processed.grid_thw == (1, 1092 // 14, 1932 // 14)  # 1920x1080 rounded up to 28-pixel merged patches
    assert processed.num_tokens == 39 * 69
    assert processed.pixel_values.shape == (78 * 138, 3 * 2 * 14 * 14)


def test_the_config_reads_the_snapshots_processor_settings(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"max_image_tokens": 64, "patch_size": 14, "foo": 1}')
    config = ImageProcessorConfig.from_snapshot(tmp_path, max_bytes=10 ** 8)
    assert (config.max_image_tokens, config.min_image_tokens, config.max_bytes) == (64, 16, 10 ** 8)
    assert ImageProcessorConfig.from_snapshot(tmp_path / "missing") == ImageProcessorConfig()
    processed = preprocess(decode_image(encode(noise_image(1920, 1080, "RGB", seed=9), "PNG"), config), config)
    assert processed.num_tokens <= 64
    reference = transformers_processor.Glm5NextImageProcessorPil(max_image_tokens=64)(
        noise_image(1920, 1080, "RGB", seed=9).convert("RGB"), return_tensors="pt")
    assert processed.grid_thw == tuple(reference["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "cannot decode image: not one of PNG, JPEG, WEBP, GIF"),
    (encode(noise_image(20, 20, "RGB", seed=1), "BMP"), "cannot decode image: not one of"),
    (encode(noise_image(20, 20, "RGB", seed=1), "TIFF"), "cannot decode image: not one of"),
    (encode(noise_image(200, 120, "RGB", seed=1), "PNG")[:300], "cannot decode PNG image"),
    (encode(noise_image(200, 120, "RGB", seed=1), "JPEG")[:400], "cannot decode (JPEG )?image"),
])
def test_bad_images_are_refused_saying_why(data, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data, CONFIG)


def test_images_over_the_limits_are_refused_before_decoding():
    data = encode(noise_image(120, 100, "RGB", seed=2), "PNG")
    with pytest.raises(ImageError, match=f"image is {len(data)} bytes, over the limit of 1000"):
        decode_image(data, ImageProcessorConfig(max_bytes=1000))
    with pytest.raises(ImageError, match="image is 120x100 pixels, over the limit of 11999 pixels"):
        decode_image(data, ImageProcessorConfig(max_pixels=11999))
    assert decode_image(data, ImageProcessorConfig(max_pixels=12000)).size == (120, 100)


@pytest.mark.parametrize("tokens", [(4, 24), (16, 64), (16, 301)], ids=lambda t: f"min{t[0]}-max{t[1]}")
@pytest.mark.parametrize("size", [(700, 300), (301, 977), (1025, 1023), (90, 60), (2000, 77)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_small_budgets_fit_as_transformers_does(size, tokens):
    """Budgets small enough that most of these sizes go through the search for the tallest canvas that fits."""
    config = ImageProcessorConfig(min_image_tokens=tokens[0], max_image_tokens=tokens[1])
    image = noise_image(*size, "RGB", seed=size[0] + tokens[1])
    ours = preprocess(to_rgb(image), config)
    processor = transformers_processor.Glm5NextImageProcessorPil(min_image_tokens=tokens[0], max_image_tokens=tokens[1])
    reference = processor(image, return_tensors="pt")
    assert ours.grid_thw == tuple(reference["image_grid_thw"][0].tolist())
    assert torch.equal(ours.pixel_values, reference["pixel_values"])
    assert tokens[0] <= ours.num_tokens <= tokens[1]
