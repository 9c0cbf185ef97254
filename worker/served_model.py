"""What the HTTP side needs of a loaded model: the async engine, its tokenizer, chat template, limits and, with a
vision tower, how images enter its prompts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from tokenizers import Tokenizer

from engine.async_engine import AsyncEngine
from engine.config import VisionConfig
from engine.loading import ExpertAvailability
from engine.engine_core import EngineCore
from engine.sampler import LogitsProcessor
from engine.sampling_params import SamplingParams
from engine.vision.placement import PlacedImage, place_images
from engine.vision.preprocess import ImageProcessorConfig, ProcessedImage, preprocess
from engine.warm_up import calibrate_routing
from worker.chat_template import ChatTemplate
from worker.engine_options import engine_options
from worker.provisioning import LoadedModel
from worker.settings import Settings

log = logging.getLogger("glmflash.worker")


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    template: ChatTemplate | None
    max_model_len: int
    vocab_size: int
    logits_processors: tuple[LogitsProcessor, ...] = ()
    experts: ExpertAvailability | None = None  # ready_at=partial: the expert fill, whose share /ready shows
    # With a vision tower and images on: the image processor (with the server's limits) and the image token ids.
    image_config: ImageProcessorConfig | None = None
    vision: VisionConfig | None = None

    @property
    def accepts_images(self) -> bool:
        """Chat requests may carry images: the model has a vision tower and the server has images on."""
        return self.image_config is not None

    @property
    def input_modalities(self) -> list[str]:
        return ["text", "image"] if self.accepts_images else ["text"]

    def place_images(self, ids: list[int], images: list[ProcessedImage]) -> tuple[list[int], tuple[PlacedImage, ...]]:
        """The prompt with each image's one image token expanded to its run, and where each image sits.
        ValueError when the prompt's image tokens and the images disagree."""
        return place_images(ids, images, self.vision.image_token_id, self.vision.video_start_token_id,
                            self.vision.video_end_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def build_served_model(loaded: LoadedModel, settings: Settings) -> ServedModel:
    """An engine over loaded weights, with the tokenizer and chat template from the snapshot's files."""
    files = loaded.files
    tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    options = engine_options(settings, loaded.miss_split_file, loaded.kernels_file)
    core = EngineCore(loaded.config, loaded.weights, options, tokenizer, loaded.experts, loaded.plan)
    if loaded.prepare is not None and core.offload is not None:
        core.offload.swaps_held = True  # the prepared snapshot is written from the slots and the host bank
    if settings.expert_calibration is not None and core.offload is not None:
        _calibrate_routing(core, tokenizer, settings.expert_calibration)
    template = ChatTemplate.from_dir(files) if _has_template(files) else None
    images = core.accepts_images and settings.max_images_per_request > 0  # what chat requests may send
    image_config = (ImageProcessorConfig.from_snapshot(files, max_bytes=settings.max_image_bytes,
                                                       max_pixels=settings.max_image_pixels) if images else None)
    log.info("event=images accepted=%s vision_tower=%s max_per_request=%d fetch_urls=%s", images,
             core.accepts_images, settings.max_images_per_request, settings.fetch_image_urls)
    return ServedModel(loaded.name, AsyncEngine(core, tokenizer), tokenizer, template, settings.max_model_len,
                       loaded.config.vocab_size, experts=loaded.experts, image_config=image_config,
                       vision=loaded.config.vision if images else None)


def _calibrate_routing(core: EngineCore, tokenizer: Tokenizer, path: Path) -> None:
    """GLMFLASH_EXPERT_CALIBRATION: one prompt per non-empty line, prefilled before ready."""
    start = time.perf_counter()
    prompts = [tokenizer.encode(line, add_special_tokens=False).ids
               for line in path.read_text().splitlines() if line.strip()]
    swaps = calibrate_routing(core, prompts)
    log.info("event=expert_calibration file=%s prompts=%d tokens=%d swaps=%d seconds=%.2f", path, len(prompts),
             sum(map(len, prompts)), swaps, time.perf_counter() - start)


def _has_template(snapshot: Path) -> bool:
    if (snapshot / "chat_template.jinja").exists():
        return True
    config = snapshot / "tokenizer_config.json"
    return config.exists() and '"chat_template"' in config.read_text()


async def warm_up(model: ServedModel) -> None:
    """One short request through the whole path, so the first user request meets warm kernels; with images on,
    a small image in it (the tower's first call sets up its kernels)."""
    ids, placed = model.encode("warm up"), ()
    image = preprocess(Image.new("RGB", (112, 112), (128, 128, 128)), model.image_config) \
        if model.accepts_images else None
    if image is not None and len(ids) + image.num_tokens + 2 <= model.max_model_len:  # room in a small context
        ids, placed = model.place_images(ids + [model.vision.image_token_id], [image])
    stream = await model.engine.generate(ids, SamplingParams(max_tokens=2, temperature=0.0), images=placed)
    async for _ in stream:
        pass
