"""Where a prompt's images sit: each image is a run of image tokens (one per merged patch) whose embeddings the
tower's output replaces at prefill.

A prompt may hold each image as one image token (what a chat template writes) or as its full run: `place_images`
expands the former and checks the latter. The prefix cache keys an image's tokens by the image's content
(`image_key`), so the same image in a next turn matches and a different image of the same size does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.vision.preprocess import ProcessedImage


@dataclass(frozen=True)
class PlacedImage:
    """An image and the prompt positions [start, start + image.num_tokens) its embeddings fill."""

    start: int
    image: ProcessedImage

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens

    @property
    def key(self) -> int:
        return image_key(self.image)


def image_key(image: ProcessedImage) -> int:
    """A negative int from the image's content digest: what the prefix cache sees in place of its tokens (no
    token id is negative, so it cannot match text)."""
    return -1 - int.from_bytes(image.digest[:8], "little")


def place_images(token_ids: list[int], images: list[ProcessedImage], image_token_id: int,
                 video_start_id: int | None = None, video_end_id: int | None = None
                 ) -> tuple[list[int], tuple[PlacedImage, ...]]:
    """(prompt with each image's run of tokens, where each image sits). Image tokens inside a video's markers
    are not images'. Raises ValueError when the prompt's image tokens do not match the images."""
    out: list[int] = []
    placed: list[PlacedImage] = []
    in_video, i = False, 0
    while i < len(token_ids):
        token = token_ids[i]
        in_video = (in_video or token == video_start_id) and token != video_end_id
        if token != image_token_id or in_video:
            out.append(token)
            i += 1
            continue
        run = 1
        while i + run < len(token_ids) and token_ids[i + run] == image_token_id:
            run += 1
        if len(placed) == len(images):
            raise ValueError(f"the prompt holds more images than the {len(images)} given")
        image = images[len(placed)]
        if run not in (1, image.num_tokens):
            raise ValueError(f"image {len(placed)} takes {image.num_tokens} image tokens; the prompt holds a run of "
                             f"{run} (give one image token per image, or the full run)")
        placed.append(PlacedImage(len(out), image))
        out.extend([image_token_id] * image.num_tokens)
        i += run
    if len(placed) != len(images):
        raise ValueError(f"{len(images)} images given, but the prompt places {len(placed)} (one image token each)")
    return out, tuple(placed)

