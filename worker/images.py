"""A chat request's images in: their URLs out of the messages in order, each read (a base64 `data:` URL, or an
http(s) URL fetched under a byte limit and a timeout), then decoded and preprocessed off the event loop, all of
them at once. Whatever is wrong with one is a 400 that names it (`messages[1].content[2]`): a client sent it, so a
client can fix it, an unreachable URL included."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from engine.vision.preprocess import ImageError, ImageProcessorConfig, ProcessedImage, decode_image, preprocess
from worker.protocol import ChatCompletionRequest, ImageContentPart, ProtocolError
from worker.served_model import ServedModel
from worker.settings import Settings

log = logging.getLogger("glmflash.worker")
HTTP_SCHEMES = ("http", "https")
CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it is (named in errors) and its URL."""

    where: str
    url: str

    @property
    def scheme(self) -> str:
        return self.url.partition(":")[0].lower() if ":" in self.url else ""

    def error(self, message: str, code: str = "invalid_image") -> ProtocolError:
        return ProtocolError(f"{self.where}: {message}", param="messages", code=code)


def image_refs(body: ChatCompletionRequest) -> list[ImageRef]:
    """The request's image parts, in the order the prompt places them."""
    return [ImageRef(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, message in enumerate(body.messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if isinstance(part, ImageContentPart)]


def check_images(refs: list[ImageRef], model: ServedModel, settings: Settings) -> None:
    """What can be refused before anything is read or fetched: images at all, how many, each URL's scheme."""
    if not refs:
        return
    if settings.max_images_per_request == 0:
        raise refs[0].error("this server does not accept images", "images_not_supported")
    if not model.accepts_images:
        raise refs[0].error("this model does not accept images (it has no vision tower)", "images_not_supported")
    if len(refs) > settings.max_images_per_request:
        raise ProtocolError(f"{len(refs)} images in the request, over the limit of "
                            f"{settings.max_images_per_request} per request", param="messages",
                            code="too_many_images")
    for ref in refs:
        if ref.scheme in HTTP_SCHEMES and not settings.fetch_image_urls:
            raise ref.error("this server does not fetch image URLs; send the image inline as a data URL "
                            "(data:image/png;base64,...)", "invalid_image_url")
        if ref.scheme not in HTTP_SCHEMES and ref.scheme != "data":
            raise ref.error(f"unsupported URL scheme {ref.scheme or '(none)'!r}; send a data URL "
                            "(data:image/png;base64,...) or an http(s) URL", "invalid_image_url")


async def load_images(refs: list[ImageRef], config: ImageProcessorConfig,
                      settings: Settings) -> list[ProcessedImage]:
    """Every image read, decoded and preprocessed, concurrently; the first failure is raised and the rest
    abandoned."""
    start = time.perf_counter()
    session = None
    if any(ref.scheme in HTTP_SCHEMES for ref in refs):
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=settings.image_fetch_timeout_s))
    tasks = [asyncio.ensure_future(_load(ref, config, session)) for ref in refs]
    try:
        images = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        if session is not None:
            await session.close()
    log.debug("event=images_loaded count=%d tokens=%d seconds=%.3f", len(images),
              sum(image.num_tokens for image in images), time.perf_counter() - start)
    return images


async def _load(ref: ImageRef, config: ImageProcessorConfig,
                session: aiohttp.ClientSession | None) -> ProcessedImage:
    fetched = None if ref.scheme == "data" else await _fetch(ref, session, config.max_bytes)
    try:
        return await asyncio.to_thread(_processed, ref, fetched, config)
    except ImageError as exc:
        raise ref.error(str(exc)) from None


def _processed(ref: ImageRef, fetched: bytes | None, config: ImageProcessorConfig) -> ProcessedImage:
    """In a worker thread: base64, image decoding and preprocessing are CPU work the event loop must not wait on."""
    data = _data_url_bytes(ref) if fetched is None else fetched
    return preprocess(decode_image(data, config), config)


def _data_url_bytes(ref: ImageRef) -> bytes:
    """`data:image/<type>;base64,<data>`; the byte limit is decode_image's."""
    header, comma, payload = ref.url.partition(",")
    media_type, *params = header[len("data:"):].split(";")
    if not comma or "base64" not in (p.strip().lower() for p in params):
        raise ref.error("a data URL must be base64: data:image/png;base64,...", "invalid_image_url")
    _check_media_type(ref, media_type.strip().lower(), "the data URL's media type")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ref.error(f"the data URL's base64 is invalid ({exc})", "invalid_image_url") from None


async def _fetch(ref: ImageRef, session: aiohttp.ClientSession, max_bytes: int) -> bytes:
    """The body of a 200 answer with an image content type, read no further than `max_bytes`."""
    host = urlsplit(ref.url).netloc.rpartition("@")[2] or ref.url  # host[:port], without credentials
    try:
        async with session.get(ref.url) as response:
            if response.status != 200:
                raise ref.error(f"fetching the image from {host} answered HTTP {response.status}",
                                "invalid_image_url")
            _check_media_type(ref, response.content_type, f"{host}'s content type")
            if response.content_length is not None and response.content_length > max_bytes:
                raise ref.error(f"image is {response.content_length} bytes, over the limit of {max_bytes}")
            data = bytearray()
            async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                data += chunk
                if len(data) > max_bytes:
                    raise ref.error(f"image is over the limit of {max_bytes} bytes")
            return bytes(data)
    except asyncio.TimeoutError:
        raise ref.error(f"fetching the image from {host} timed out after {session.timeout.total:g}s",
                        "invalid_image_url") from None
    except aiohttp.ClientConnectorError as exc:
        raise ref.error(f"cannot connect to {host} to fetch the image: {exc.os_error.strerror or exc.os_error}",
                        "invalid_image_url") from None
    except aiohttp.ClientError as exc:
        raise ref.error(f"fetching the image from {host} failed: {exc}", "invalid_image_url") from None


def _check_media_type(ref: ImageRef, media_type: str, what: str) -> None:
    if not media_type.startswith("image/"):
        raise ref.error(f"{what} is {media_type or '(none)'!r}, not an image type (image/*)", "invalid_image_url")
