"""Chat messages with images over the OpenAI API, on real servers of the tiny model (which has a small vision
tower), through the official `openai` client: data URLs and http URLs served by a local aiohttp server; the
greedy answer equal to the offline engine's for the same prompt and image (so the image reaches the model);
several images, streaming, /tokenize and /v1/models; every bad image a 4xx with an OpenAI error body, after
which the server still answers."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from pathlib import Path

import openai
import pytest
import torch
from aiohttp import web
from PIL import Image
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.tiny.factory import write_tiny_model
from engine.vision.preprocess import ImageProcessorConfig, image_tokens
from server_helpers import MODEL_NAME, assert_error_body, free_port, make_settings, start_server, stop_server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = dict(model=MODEL_NAME, max_tokens=8, temperature=0, logprobs=True, extra_body={"ignore_eos": True,
                                                                                        **NO_THINKING})
PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
# The limited server's limits: a 32x32 noise PNG (about 3 KB) passes them, 16 image tokens each.
SMALL_CONTEXT, SMALL_BYTES, SMALL_PIXELS, SMALL_COUNT = 40, 8000, 10_000, 2


# --- images and messages ------------------------------------------------------------------------------


def picture(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).byte().numpy())


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = encoded(picture(48, 40, 0))
OTHER_PNG = encoded(picture(48, 40, 1))
JPEG = encoded(picture(40, 56, 2), "JPEG")
SMALL_PNG = encoded(picture(32, 32, 3))


def user(text: str, *urls: str, detail: str | None = None) -> dict:
    """A user message: the text, then each URL as an image part."""
    images = [{"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
              for url in urls]
    return {"role": "user", "content": [{"type": "text", "text": text}, *images]}


def template_messages(messages: list[dict]) -> list[dict]:
    """What transformers' template takes: `{"type": "image"}` where the request has an image part."""
    return [{**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def post(server, body: dict, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    status, _, raw = server.post(path, {"model": MODEL_NAME, "max_tokens": 2, **body})
    return status, raw


def answer(client, messages: list[dict]) -> tuple[list[str], list[float]]:
    """The greedy answer's tokens and their logprobs."""
    response = client.chat.completions.create(messages=messages, **GREEDY)
    entries = response.choices[0].logprobs.content
    return [e.token for e in entries], [e.logprob for e in entries]


def assert_image_chat_works(server) -> None:
    """A good image request right after a bad one still succeeds."""
    server.check_alive()
    status, raw = post(server, {"messages": [user("Still there?", data_url(SMALL_PNG))], "ignore_eos": True})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 2


# --- servers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(launch):
    """A 40-token context, small byte and pixel limits, two images per request, a one-second fetch timeout."""
    return launch(max_model_len=SMALL_CONTEXT, max_image_bytes=SMALL_BYTES, max_image_pixels=SMALL_PIXELS,
                  max_images_per_request=SMALL_COUNT, image_fetch_timeout_s=1.0)


@pytest.fixture(scope="module")
def no_fetch(launch):
    return launch(fetch_image_urls=False)


@pytest.fixture(scope="module")
def images_off(launch):
    return launch(max_images_per_request=0)


def drop_vision_tower(snapshot: Path) -> None:
    """Rewrite the shards and index without `model.visual.*`: a text-only checkpoint."""
    index_path = snapshot / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(snapshot / name))
        save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, str(snapshot / name),
                  metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("model.visual.")}
    index_path.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """A server over a checkpoint without a vision tower."""
    snapshot = write_tiny_model(tmp_path_factory.mktemp("text-only") / "tiny", "bf16", 0)
    drop_vision_tower(snapshot)
    server = start_server(make_settings(snapshot, tmp_path_factory.mktemp("text-only-cache")))
    yield server
    stop_server(server)


class ImageHost:
    """A local aiohttp server the model's server fetches image URLs from, in its own thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="image-host", daemon=True)

    def _app(self) -> web.Application:
        async def endless(request: web.Request) -> web.StreamResponse:  # an image body that never ends
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            await response.prepare(request)
            while True:
                await response.write(b"\0" * 65536)

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.Response(body=PNG, content_type="image/png")

        app = web.Application()
        app.router.add_get("/noise.png", _serving(PNG, "image/png"))
        app.router.add_get("/other.png", _serving(OTHER_PNG, "image/png"))
        app.router.add_get("/photo.jpg", _serving(JPEG, "image/jpeg"))
        app.router.add_get("/page.html", _serving(PNG, "text/html"))
        app.router.add_get("/big.png", _serving(encoded(picture(64, 64, 4)), "image/png"))
        app.router.add_get("/endless.png", endless)
        app.router.add_get("/slow.png", slow)
        return app

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self._app(), handler_cancellation=True)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def start(self) -> "ImageHost":
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _serving(body: bytes, content_type: str):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    return handler


@pytest.fixture(scope="module")
def host():
    image_host = ImageHost().start()
    yield image_host.url
    image_host.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tokenizer):
    """The offline engine's greedy answer (token strings) for the server's prompt and images."""
    llm = LLM(tiny_model_dir, dtype="float32")

    def greedy(messages: list[dict], images: list[bytes]) -> list[str]:
        ids = tokenizer.apply_chat_template(template_messages(messages), tokenize=True, add_generation_prompt=True,
                                            enable_thinking=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        return [tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]

    return greedy


# --- images reach the model -------------------------------------------------------------------------------


@pytest.mark.parametrize("image, media_type", [(PNG, "image/png"), (JPEG, "image/jpeg")], ids=["png", "jpeg"])
def test_a_data_url_image_is_answered_as_the_offline_engine_answers(client, reference, image, media_type):
    messages = [user("What is in this picture?", data_url(image, media_type), detail="low")]
    tokens, _ = answer(client, messages)
    assert tokens == reference(messages, [image])


def test_a_different_image_gives_a_different_answer(client, reference):
    first, _ = answer(client, [user("Describe it.", data_url(PNG))])
    second, _ = answer(client, [user("Describe it.", data_url(OTHER_PNG))])
    assert first != second
    assert second == reference([user("Describe it.", data_url(OTHER_PNG))], [OTHER_PNG])


def test_an_http_url_image_is_fetched(client, host, reference):
    over_http = answer(client, [user("Describe it.", f"{host}/noise.png")])
    assert over_http == answer(client, [user("Describe it.", data_url(PNG))])
    assert over_http[0] == reference([user("Describe it.", f"{host}/noise.png")], [PNG])


def test_several_images_in_one_message_and_across_messages(client, host, reference):
    messages = [user("First these two:", data_url(PNG), f"{host}/photo.jpg"),
                {"role": "assistant", "content": "Two pictures."},
                user("And this one?", f"{host}/other.png")]
    tokens, _ = answer(client, messages)
    assert tokens == reference(messages, [PNG, JPEG, OTHER_PNG])
    swapped = [user("First these two:", f"{host}/photo.jpg", data_url(PNG)), *messages[1:]]
    assert answer(client, swapped)[0] == reference(swapped, [JPEG, PNG, OTHER_PNG])


def test_streaming_with_an_image_equals_the_whole_answer(client):
    messages = [user("Describe it.", data_url(PNG))]
    whole = client.chat.completions.create(messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (whole.choices[0].message.content or "")
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_usage_and_tokenize_count_the_image_tokens(server, client, tokenizer):
    messages = [user("Count me.", data_url(PNG), data_url(JPEG))]
    text_ids = tokenizer.apply_chat_template(template_messages(messages), tokenize=True, add_generation_prompt=True)
    text_ids = list(text_ids["input_ids"] if hasattr(text_ids, "keys") else text_ids)
    status, raw = post(server, {"messages": messages, "return_token_strs": True}, "/tokenize")
    assert status == 200, raw
    body = json.loads(raw)
    expected = image_tokens(40, 48, ImageProcessorConfig()) + image_tokens(56, 40, ImageProcessorConfig())
    assert body["token_strs"].count("<|image|>") == expected
    assert body["count"] == len(text_ids) - 2 + expected
    usage = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]


def test_n_samples_share_the_image(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=[user("Describe it.", data_url(PNG))],
                                              n=2, max_tokens=3, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 6


# --- /v1/models ---------------------------------------------------------------------------------------------


def test_models_list_the_input_modalities(server, text_only, images_off):
    assert json.loads(server.get("/v1/models")[2])["data"][0]["input_modalities"] == ["text", "image"]
    assert json.loads(text_only.get("/v1/models")[2])["data"][0]["input_modalities"] == ["text"]
    assert json.loads(images_off.get("/v1/models")[2])["data"][0]["input_modalities"] == ["text"]


# --- bad images: a 4xx naming the image, and the server goes on ---------------------------------------------


@pytest.mark.parametrize("url, code, message", [
    (data_url(b"not an image at all"), "invalid_image", "cannot decode image"),
    (data_url(encoded(picture(8, 8, 0), "BMP"), "image/bmp"), "invalid_image", "not one of PNG, JPEG, WEBP, GIF"),
    (data_url(encoded(picture(8, 8, 0), "TIFF"), "image/tiff"), "invalid_image", "not one of PNG, JPEG, WEBP, GIF"),
    ("data:image/png;base64,@@not-base64@@", "invalid_image_url", "base64 is invalid"),
    ("data:image/png," + "x" * 8, "invalid_image_url", "must be base64"),
    (data_url(PNG, "text/plain"), "invalid_image_url", "'text/plain', not an image"),
    ("ftp://example.com/cat.png", "invalid_image_url", "unsupported URL scheme 'ftp'"),
    ("file:///etc/hostname", "invalid_image_url", "unsupported URL scheme 'file'"),
    ("cat.png", "invalid_image_url", "unsupported URL scheme '(none)'"),
], ids=["undecodable", "bmp", "tiff", "bad-base64", "not-base64", "data-not-image", "ftp", "file", "no-scheme"])
def test_a_bad_image_is_a_400_naming_it(server, url, code, message):
    messages = [user("First:", data_url(PNG)), user("Second:", url)]
    status, raw = post(server, {"messages": messages})
    assert status == 400, raw
    error = assert_error_body(raw, 400, param="messages", code=code)
    assert error["message"].startswith("messages[1].content[1]: ") and message in error["message"], error
    assert_image_chat_works(server)


def test_url_failures_are_400s_naming_the_host(server, host):
    closed = f"127.0.0.1:{free_port()}"
    cases = [(f"http://{closed}/cat.png", f"cannot connect to {closed}"),
             (f"{host}/page.html", "content type is 'text/html', not an image"),
             (f"{host}/missing.png", "answered HTTP 404")]
    for url, message in cases:
        status, raw = post(server, {"messages": [user("Look:", url)]})
        error = assert_error_body(raw, 400, param="messages", code="invalid_image_url")
        assert status == 400 and error["message"].startswith("messages[0].content[1]: ") and message in error[
            "message"], error
        assert_image_chat_works(server)


def test_a_bad_image_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[user("Look:", data_url(b"junk"))], max_tokens=2)
    assert caught.value.status_code == 400 and "cannot decode image" in caught.value.message


def test_image_parts_only_in_user_messages(server):
    system = {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]}
    status, raw = post(server, {"messages": [system, user("Hi")]})
    assert status == 400
    assert_error_body(raw, 400, param="messages[0].content[0]", code="invalid_value")


@pytest.mark.parametrize("make_url, message", [
    (lambda host: data_url(encoded(picture(64, 64, 4))), f"over the limit of {SMALL_BYTES}"),
    (lambda host: f"{host}/big.png", f"over the limit of {SMALL_BYTES}"),
    (lambda host: f"{host}/endless.png", f"over the limit of {SMALL_BYTES} bytes"),  # stops reading there
    (lambda host: data_url(encoded(Image.new("RGB", (101, 100)))), f"over the limit of {SMALL_PIXELS} pixels"),
    (lambda host: f"{host}/slow.png", "timed out after 1s"),
], ids=["bytes", "bytes-http", "bytes-endless-http", "pixels", "timeout"])
def test_limits_are_400s(limited, host, make_url, message):
    status, raw = post(limited, {"messages": [user("Look:", make_url(host))]})
    assert status == 400, raw
    error = assert_error_body(raw, 400, param="messages")
    assert message in error["message"], error
    assert_image_chat_works(limited)


def test_too_many_images_is_a_400_before_any_is_read(limited, host):
    urls = [data_url(SMALL_PNG)] * SMALL_COUNT + [f"{host}/endless.png"]
    status, raw = post(limited, {"messages": [user("Look:", *urls)]})
    assert status == 400
    error = assert_error_body(raw, 400, param="messages", code="too_many_images")
    assert f"3 images in the request, over the limit of {SMALL_COUNT}" in error["message"]
    assert_image_chat_works(limited)


def test_images_that_do_not_fit_the_context_are_a_400_with_the_counts(limited):
    status, raw = post(limited, {"messages": [user("Look:", data_url(SMALL_PNG), data_url(SMALL_PNG))]})
    assert status == 400
    error = assert_error_body(raw, 400, param="messages", code="context_length_exceeded")
    assert "images do not fit the context" in error["message"], error
    assert "32 of them for 2 image(s)" in error["message"] and f"limit is {SMALL_CONTEXT} tokens" in error["message"]
    assert_image_chat_works(limited)


def test_a_model_without_a_vision_tower_refuses_images_before_fetching(text_only, host):
    status, raw = post(text_only, {"messages": [user("Look:", f"{host}/slow.png")]})
    assert status == 400
    error = assert_error_body(raw, 400, param="messages", code="images_not_supported")
    assert "this model does not accept images" in error["message"]
    status, raw = post(text_only, {"messages": [user("Just text.")], "ignore_eos": True})
    assert status == 200, raw


def test_images_turned_off_are_refused(images_off):
    status, raw = post(images_off, {"messages": [user("Look:", data_url(SMALL_PNG))]})
    assert status == 400
    error = assert_error_body(raw, 400, param="messages", code="images_not_supported")
    assert "this server does not accept images" in error["message"]


def test_without_url_fetching_only_data_urls_are_taken(no_fetch, host):
    status, raw = post(no_fetch, {"messages": [user("Look:", f"{host}/noise.png")]})
    assert status == 400
    error = assert_error_body(raw, 400, param="messages", code="invalid_image_url")
    assert "does not fetch image URLs" in error["message"] and error["message"].startswith("messages[0].content[1]")
    assert_image_chat_works(no_fetch)
