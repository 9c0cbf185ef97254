"""A server with the fp8 latent cache (GLMFLASH_KV_CACHE_DTYPE=fp8) over the embedded tiny model answers through the
official client, streamed and not, with the same tokens both ways, and refuses a prompt past max_model_len with a
400 that names the limit."""

from __future__ import annotations

import openai
import pytest

from server_helpers import make_settings, start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(make_settings(None, tmp_path_factory.mktemp("cache"), kv_cache_dtype="fp8",
                                         max_model_len=256))
    yield started
    stop_server(started)


def test_fp8_cache_server_answers_and_refuses_past_the_context(server):
    assert server.settings.kv_cache_dtype == "fp8"
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as client:
        kwargs = dict(model=server.settings.served_model_name, prompt="The quick brown fox", max_tokens=12,
                      temperature=0.0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == whole.choices[0].text
        with pytest.raises(openai.BadRequestError, match="256"):
            client.completions.create(**{**kwargs, "prompt": "fox " * 400})
        assert client.completions.create(**kwargs).choices[0].text == whole.choices[0].text  # still serving
