"""A server with speculative decoding on (GLMFLASH_SPECULATIVE_TOKENS=2) over the embedded tiny model
(no model given: it carries an MTP layer, as the release does) answers greedy requests exactly as one without it,
streamed or not, cut by a stop string or not, and /metrics counts its drafts."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from server_helpers import make_settings, start_server, stop_server
from worker.metrics import samples

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = [start_server(make_settings(None, tmp_path_factory.mktemp("cache"), prefix_cache=False, **flags))
               for flags in ({}, {"speculative_tokens": 2})]
    yield started
    for server in started:
        stop_server(server)


def completion(server, stream: bool, stop: str | None = None) -> str:
    with openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60) as client:
        kwargs = dict(model=server.settings.served_model_name, prompt=PROMPT, max_tokens=17, temperature=0.0,
                      stop=stop, extra_body={"ignore_eos": True})
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                       if chunk.choices)


def test_speculative_answers_equal_plain_ones_and_drafts_are_counted(servers):
    plain, speculative = servers
    want = completion(plain, stream=False)
    assert want and completion(speculative, stream=False) == want
    assert completion(speculative, stream=True) == want
    stop = want[len(want) // 2:len(want) // 2 + 2]  # a stop string inside the answer: it may end a verified run
    cut = completion(plain, stream=False, stop=stop)
    assert len(cut) < len(want) and completion(speculative, stream=False, stop=stop) == cut
    assert completion(speculative, stream=True, stop=stop) == cut
    with urllib.request.urlopen(speculative.url + "/metrics") as response:
        got = samples(response.read().decode())
    assert got['glmflash_spec_draft_tokens{outcome="proposed"}'] > 0
    assert got['glmflash_spec_verified_drafts{outcome="verified"}'] > 0
