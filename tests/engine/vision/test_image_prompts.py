"""Image prompts through the whole engine against transformers' Glm5NextForConditionalGeneration (pixel values
in, the tower's output at the image tokens): logits in float32 for every release format (the tower is BF16 in
each), greedy tokens, the bf16 loss within what
bf16 itself loses; an image split across prefill chunks, image and text requests batched together, and the
prefix cache keyed by image content."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from engine.model.vision import VisionTower
from engine.vision.placement import place_images
from engine.vision.preprocess import ImageProcessorConfig, ProcessedImage, preprocess
from tests.engine.conftest import FORMATS, Outputs, random_prompt, reference_outputs
from tests.engine.test_bf16 import FACTOR, errors
from tests.engine.test_parity import assert_close

IMAGE, IMAGE_START, IMAGE_END = 270, 266, 267  # the tiny tokenizer's image token and markers
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def picture(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).byte().numpy())


def processed(width: int, height: int, seed: int) -> ProcessedImage:
    return preprocess(picture(width, height, seed), ImageProcessorConfig())


def text(length: int, seed: int) -> list[int]:
    """Random tiny-vocabulary tokens without image or video markers (266-271)."""
    return [t if not 266 <= t <= 271 else t - 10 for t in random_prompt(length, seed)]


def with_images(*pieces: list[int]) -> list[int]:
    """Text pieces with an image (its markers and one image token) between each two."""
    out = list(pieces[0])
    for piece in pieces[1:]:
        out += [IMAGE_START, IMAGE, IMAGE_END] + piece
    return out


def expanded(ids: list[int], images: list[ProcessedImage]) -> list[int]:
    return place_images(ids, images, IMAGE)[0]


@pytest.fixture(scope="module")
def snapshot(tiny_dir):
    return tiny_dir("bf16")


@pytest.fixture(scope="module")
def fp32(snapshot) -> LLM:
    return LLM(snapshot, dtype="float32", page_size=16)


@pytest.fixture(scope="module")
def two_images() -> list[ProcessedImage]:
    return [processed(90, 60, seed=1), processed(40, 130, seed=2)]


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return with_images(text(20, 1), text(15, 2), text(10, 3))


def test_two_images_take_their_tokens(two_images, prompt_ids):
    assert [image.num_tokens for image in two_images] == [20, 24]  # scaled up to at least 16 tokens
    ids, placed = place_images(prompt_ids, two_images, IMAGE)
    assert [(p.start, p.end) for p in placed] == [(21, 41), (58, 82)]
    assert ids[21:41] == [IMAGE] * 20 and ids[20] == IMAGE_START and ids[41] == IMAGE_END
    assert place_images(ids, two_images, IMAGE) == (ids, placed)  # full runs are taken as they are


def test_placement_errors_say_what_is_wrong(two_images, prompt_ids):
    with pytest.raises(ValueError, match="2 images given, but the prompt places 1"):
        place_images(with_images(text(4, 0), text(4, 1)), two_images, IMAGE)
    with pytest.raises(ValueError, match="more images than the 1 given"):
        place_images(prompt_ids, two_images[:1], IMAGE)
    with pytest.raises(ValueError, match="takes 20 image tokens; the prompt holds a run of 3"):
        place_images([1, IMAGE, IMAGE, IMAGE, 2], two_images[:1], IMAGE)
    # Image tokens between a video's markers are the video's, not an image's.
    assert place_images([268, IMAGE, 269, 5], [], IMAGE, 268, 269) == ([268, IMAGE, 269, 5], ())


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_logits_match_transformers(fmt, tiny_dir, reference, two_images, prompt_ids):
    snapshot = tiny_dir(fmt)
    ids = expanded(prompt_ids, two_images)
    ours = LLM(snapshot, dtype="float32").prompt_logits({"prompt_token_ids": prompt_ids,
                                                         "multi_modal_data": {"image": two_images}})
    want = reference_outputs(reference(snapshot), ids, two_images).logits
    assert_close(ours, want)
    # The images matter: the same tokens with the embedding table's image rows differ after the first image.
    text_only = reference_outputs(reference(snapshot), ids).logits
    assert (want[22:] - text_only[22:]).abs().max() > 0.1 * want.abs().max()


def test_greedy_continuation_matches_transformers(fp32, reference, snapshot, two_images, prompt_ids):
    out = fp32.generate([{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": two_images}}], GREEDY)[0]
    ids, model, want = expanded(prompt_ids, two_images), reference(snapshot), []
    for _ in range(GREEDY.max_tokens):
        want.append(int(reference_outputs(model, ids + want, two_images).logits[-1].argmax()))
    assert out.prompt_token_ids == ids and out.token_ids == want


def test_bf16_loses_no_more_than_bf16_itself(tiny_dir, reference, two_images, prompt_ids):
    snapshot = tiny_dir("bf16", well_conditioned=True)
    prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": two_images}}
    llm = LLM(snapshot, dtype="bfloat16")
    ids = expanded(prompt_ids, two_images)
    want = reference_outputs(reference(snapshot), ids, two_images)
    base = reference_outputs(reference(snapshot, torch.bfloat16), ids, two_images)
    ours = Outputs([t.float() for t in llm.layer_outputs(prompt)], llm.prompt_logits(prompt))
    for i, (o, b) in enumerate(zip(errors(ours, want), errors(base, want))):
        assert o <= FACTOR * b, f"{'logits' if i == len(ours.layers) else f'layer {i}'}: {o:.2e} > {FACTOR} x {b:.2e}"
    assert llm.generate([prompt], GREEDY)[0].token_ids[:2] == [int(want.logits[-1].argmax())] + \
        [int(reference_outputs(reference(snapshot), ids + [int(want.logits[-1].argmax())], two_images)
             .logits[-1].argmax())]


def count_tower_images(llm: LLM, monkeypatch) -> list[int]:
    """Images per tower call from here on."""
    calls: list[int] = []
    original = VisionTower.__call__

    def counted(self, pixels, grids):
        calls.append(len(grids))
        return original(self, pixels, grids)

    monkeypatch.setattr(VisionTower, "__call__", counted)
    return calls


def test_an_image_split_across_prefill_chunks(snapshot, fp32, two_images, prompt_ids, monkeypatch):
    prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": two_images}}
    whole = fp32.generate([prompt], GREEDY)[0].token_ids
    chunked = LLM(snapshot, dtype="float32", max_num_batched_tokens=8, max_num_seqs=1, prefix_cache=False)
    calls = count_tower_images(chunked, monkeypatch)
    assert chunked.generate([prompt], GREEDY)[0].token_ids == whole
    assert calls == [1, 1]  # each image through the tower once, though its tokens ran in 2-3 steps
    assert not any(chunked.runner.images._kept.values())  # nothing held once the images' last tokens ran


def test_image_and_text_requests_together_equal_alone(snapshot, two_images, prompt_ids, monkeypatch):
    llm = LLM(snapshot, dtype="float32", prefix_cache=False)
    prompts = [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": two_images}}, text(30, 7),
               {"prompt_token_ids": with_images(text(5, 8), text(12, 9)),
                "multi_modal_data": {"image": [processed(200, 100, seed=3)]}}]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    calls = count_tower_images(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == alone
    assert calls == [3]  # the step's three images in one tower call


def test_prefix_cache_keys_images_by_content(snapshot, two_images, prompt_ids):
    llm = LLM(snapshot, dtype="float32", page_size=16)
    first = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": two_images}}
    answer = llm.generate([first], GREEDY)[0]
    # The next turn: the same conversation and images, then more text.
    turn = {"prompt_token_ids": answer.prompt_token_ids + answer.token_ids + text(9, 4),
            "multi_modal_data": {"image": two_images}}
    other = [two_images[0], processed(40, 130, seed=9)]  # the second image differs, its size does not
    assert other[1].num_tokens == two_images[1].num_tokens and other[1].digest != two_images[1].digest
    assert processed(40, 130, seed=2).digest == two_images[1].digest
    swapped = {**turn, "multi_modal_data": {"image": other}}
    got = [llm.generate([p], GREEDY)[0] for p in (turn, swapped)]
    assert got[0].num_cached_tokens >= len(answer.prompt_token_ids)  # the whole first turn, images and all
    assert got[1].num_cached_tokens <= 58  # the second image's start at most: it is a different image
    uncached = LLM(snapshot, dtype="float32", page_size=16, prefix_cache=False)
    assert [o.token_ids for o in got] == [uncached.generate([p], GREEDY)[0].token_ids for p in (turn, swapped)]
