"""The prefix cache through the server: answers equal those of a server without it, cached_tokens in usage,
hits and evictions in /metrics, n > 1 prefills once, a client leaving mid-stream leaves the sharers intact."""

from __future__ import annotations

import random

import openai
import pytest

from server_helpers import MODEL_NAME

SYSTEM = "You are a careful agent. " + " ".join(random.Random(0).choices(
    "alpha beta gamma delta tool call search read write plan check result error retry".split(), k=60))
PLAIN = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def cached(launch):
    return launch()


@pytest.fixture(scope="module")
def uncached(launch):
    return launch(prefix_cache=False)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)


def chat(server, messages: list[dict], max_tokens: int = 8, **extra):
    with client(server) as c:
        return c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                         extra_body=PLAIN, **extra)


def complete(server, prompt: str, max_tokens: int = 8, **extra):
    with client(server) as c:
        return c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True}, **extra)


def computed(server) -> float:
    return server.metric("glmflash_prompt_tokens_computed")


def test_conversation_turns_hit_and_answer_as_without_the_cache(cached, uncached):
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: list the files in /tmp/{turn}."})
        hit, miss = chat(cached, messages), chat(uncached, messages)
        assert hit.choices[0].message.content == miss.choices[0].message.content
        assert miss.usage.prompt_tokens_details.cached_tokens == 0
        cached_tokens = hit.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached_tokens == 0
        else:  # at least the last prompt less its final token, at most the last prompt and its answer
            assert previous_prompt - 1 <= cached_tokens <= previous_prompt + 7
        previous_prompt = hit.usage.prompt_tokens
        messages.append({"role": "assistant", "content": hit.choices[0].message.content})
    metrics = cached.metrics()
    assert metrics["glmflash_prefix_cache_hits"] >= 2
    assert metrics["glmflash_prefix_cache_hit_tokens"] >= 2 * (len(SYSTEM) - 1)


def test_n_samples_prefill_the_prompt_once(cached, uncached):
    prompt = SYSTEM + " Count the tools."
    before = computed(cached)
    response = complete(cached, prompt, n=3)
    length = response.usage.prompt_tokens
    assert computed(cached) - before == length + 2  # once, then each other sample's last prompt token
    reference = complete(uncached, prompt).choices[0].text
    assert [c.text for c in response.choices] == [reference] * 3
    again = complete(cached, prompt, n=2)  # the whole prompt but its last token is cached now
    assert again.usage.prompt_tokens_details.cached_tokens == length - 1
    assert [c.text for c in again.choices] == [reference] * 2


def test_streamed_usage_reports_cached_tokens(cached):
    prompt = SYSTEM + " Stream this."
    complete(cached, prompt)
    with client(cached) as c:
        stream = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == usage[-1].prompt_tokens - 1


def test_eviction_under_a_small_budget(launch, uncached):
    tight = launch(prefix_cache_gib=3.1e-4)  # two snapshots of the tiny model, no extra pages
    for i in range(3):
        messages = [{"role": "system", "content": f"{i} {SYSTEM}"}, {"role": "user", "content": "Go."}]
        for _ in range(2):
            reply = chat(tight, messages)
            assert reply.choices[0].message.content == chat(uncached, messages).choices[0].message.content
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Again."}]
    metrics = tight.metrics()
    assert metrics['glmflash_prefix_cache_evictions{kind="snapshot"}'] > 0
    assert metrics['glmflash_prefix_cache_entries{kind="snapshot",tier="device"}'] == 2
    assert metrics["glmflash_prefix_cache_hits"] >= 3  # each conversation's second turn


def test_client_leaving_mid_stream_leaves_the_sharing_requests_intact(cached, uncached):
    system = [{"role": "system", "content": "Shared prefix. " + SYSTEM}]
    chat(cached, system + [{"role": "user", "content": "warm"}], max_tokens=2)  # cache the shared prefix
    ask = [system + [{"role": "user", "content": f"question {i}"}] for i in range(2)]
    hits_before = cached.metric("glmflash_prefix_cache_hits")
    with client(cached) as c:
        leaving = c.chat.completions.create(model=MODEL_NAME, messages=system + [{"role": "user", "content": "bye"}],
                                            max_tokens=400, temperature=0, stream=True, extra_body=PLAIN)
        next(iter(leaving))
        kept = [chat(cached, m, max_tokens=12) for m in ask]  # share the prefix pages with the open stream
        leaving.close()  # the client disconnects: its request is aborted, its hold on the pages dropped
    after = chat(cached, ask[0], max_tokens=12)
    for messages, reply in zip(ask + ask[:1], kept + [after]):
        assert reply.choices[0].message.content == chat(uncached, messages, max_tokens=12).choices[0].message.content
        assert reply.usage.prompt_tokens_details.cached_tokens >= len(system[0]["content"]) // 64 * 64  # its pages
    assert cached.metric("glmflash_prefix_cache_hits") - hits_before == 3  # the sharers and the one after (the leaver branched first)
