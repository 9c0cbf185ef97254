"""The OpenAI routes of a real server on a real port, through the official `openai` client (and raw aiohttp).

The tiny model has random weights, so its text is junk: these tests check shapes, token accounting,
stream/whole agreement, determinism and logprob values, not what the text says.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from server_helpers import MODEL_NAME, raw_stream

IGNORE_EOS = {"ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the tests."}]


def chat_prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- /v1/models -------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by


# --- usage accounting -----------------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [None, False])
def test_chat_usage_counts_prompt_and_generated_tokens(client, tokenizer, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    extra = dict(IGNORE_EOS, **({"chat_template_kwargs": kwargs} if kwargs else {}))
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                              extra_body=extra)
    assert response.object == "chat.completion"
    assert response.model == MODEL_NAME
    assert response.id.startswith("chatcmpl-")
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert response.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES, **kwargs))
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5


def test_completion_usage_counts_prompt_and_generated_tokens(client, tokenizer):
    prompt = "The quick brown fox"
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body=IGNORE_EOS)
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6
    assert response.choices[0].finish_reason == "length"
    assert isinstance(response.choices[0].text, str)


def test_model_field_is_optional(server):
    status, _, body = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["model"] == MODEL_NAME


def test_completions_default_max_tokens_is_16(client):
    response = client.completions.create(model=MODEL_NAME, prompt="a", temperature=0, extra_body=IGNORE_EOS)
    assert response.usage.completion_tokens == 16


# --- streaming ------------------------------------------------------------------------------------


def test_chat_stream_equals_whole_and_reports_usage(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks, "no chunks"
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL_NAME for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks[:-1])
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    reasons = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_completion_stream_equals_whole_and_reports_usage(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=0, stream=True,
                                            extra_body=IGNORE_EOS))
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "raw stream"}),
])
def test_raw_stream_is_sse_and_ends_with_done(server, route, body):
    request = dict(body, model=MODEL_NAME, max_tokens=4, temperature=0, stream=True, ignore_eos=True,
                   stream_options={"include_usage": True})
    status, headers, events = asyncio.run(raw_stream(server.url + route, request))
    assert status == 200, events
    assert headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["usage"]["completion_tokens"] == 4
    assert payloads[-1]["choices"] == []


# --- n, token-id prompts --------------------------------------------------------------------------


def test_chat_n2_returns_two_choices(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=4,
                                              temperature=1.0, seed=7, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 8


def test_completion_n2_streamed_gives_both_indexes(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="two", n=2, max_tokens=3, temperature=1.0,
                                            seed=3, stream=True, stream_options={"include_usage": True},
                                            extra_body=IGNORE_EOS))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 6


def test_token_id_prompts(client):
    text = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, temperature=0,
                                     extra_body=IGNORE_EOS)
    ids = client.completions.create(model=MODEL_NAME, prompt=[104, 105], max_tokens=4, temperature=0,
                                    extra_body=IGNORE_EOS)
    assert ids.choices[0].text == text.choices[0].text
    assert ids.usage.prompt_tokens == 2
    batch = client.completions.create(model=MODEL_NAME, prompt=[[104, 105], [104, 105, 33]], max_tokens=4,
                                      temperature=0, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 8
    first = next(c for c in batch.choices if c.index == 0)
    assert first.text == text.choices[0].text


def test_echo_prepends_the_prompt(client):
    response = client.completions.create(model=MODEL_NAME, prompt="echo me", echo=True, max_tokens=2,
                                         temperature=0, extra_body=IGNORE_EOS)
    assert response.choices[0].text.startswith("echo me")


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, reference):
    """What evaluation harnesses send to score a text: every prompt token after the first gets its logprob
    (the first has none), then the completion's; offsets count characters, multi-byte ones too."""
    prompt, steps = "Ünïcode prompt — scored", 3
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=steps,
                                         temperature=0, extra_body=IGNORE_EOS)
    choice, lp = response.choices[0], response.choices[0].logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + steps
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    rows = torch.log_softmax(reference.llm.prompt_logits(ids).double(), dim=-1)
    for position in range(1, len(ids)):
        want = rows[position - 1]
        assert lp.tokens[position] == tokenizer.decode([ids[position]], skip_special_tokens=False)
        assert lp.token_logprobs[position] == pytest.approx(float(want[ids[position]]), abs=2e-3)
        assert max(lp.top_logprobs[position].values()) == pytest.approx(float(want.max()), abs=2e-3)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in token:  # a lone byte of a multi-byte character reads U+FFFD
            assert choice.text[offset:offset + len(token)] == token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)
    tokens, _ = reference(ids, steps)
    assert lp.tokens[len(ids):] == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=steps, temperature=0, stream=True,
        extra_body=IGNORE_EOS) if c.choices and c.choices[0].logprobs]
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [v for part in streamed for v in part.token_logprobs] == lp.token_logprobs


# --- seeds ----------------------------------------------------------------------------------------


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt="Random", max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body=IGNORE_EOS).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first  # 8 tokens from 320: equal by chance with negligible probability


def test_seeded_chat_stream_equals_seeded_whole(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=99,
                  extra_body=dict(IGNORE_EOS, chat_template_kwargs={"enable_thinking": False}))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == (whole or "")


# --- logprobs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The offline engine over the same snapshot: log_softmax from one full prefill per check."""
    from engine.llm import LLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_seqs=1, max_model_len=256)

    def greedy_logprobs(prompt_ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """(greedy tokens, log_softmax rows [steps, V] that chose them), recomputed by full prefills."""
        ids = list(prompt_ids)
        for _ in range(steps):
            ids.append(int(llm.prompt_logits(ids)[-1].argmax()))
        rows = torch.log_softmax(llm.prompt_logits(ids).float(), dim=-1)
        return ids[len(prompt_ids):], rows[len(prompt_ids) - 1: len(ids) - 1]

    greedy_logprobs.llm = llm
    return greedy_logprobs


def test_chat_logprobs_match_log_softmax(client, tokenizer, reference):
    steps = 5
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=steps, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens == steps
    tokens, rows = reference(chat_prompt_ids(tokenizer, MESSAGES), steps)
    for entry, token, row in zip(entries, tokens, rows):
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen one is the best
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        top = torch.topk(row, 2).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top, abs=2e-3)


def test_chat_logprobs_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True, extra_body=IGNORE_EOS))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 1 for e in entries)


def test_chat_without_logprobs_has_null_logprobs(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0,
                                              extra_body=IGNORE_EOS)
    assert response.choices[0].logprobs is None


def test_completion_logprobs_match_log_softmax(client, tokenizer, reference):
    prompt, steps = "hello", 24
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=steps, temperature=0,
                                         logprobs=2, extra_body=IGNORE_EOS)
    lp = response.choices[0].logprobs
    assert response.usage.completion_tokens == steps
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == steps
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    tokens, rows = reference(tokenizer.encode(prompt, add_special_tokens=False), steps)
    for i, (token, row) in enumerate(zip(tokens, rows)):
        chosen, top = lp.token_logprobs[i], lp.top_logprobs[i]
        assert chosen <= 0
        assert lp.tokens[i] == tokenizer.decode([token], skip_special_tokens=False)
        assert chosen == pytest.approx(float(row[token]), abs=2e-3)
        assert 1 <= len(top) <= 2  # token texts may collide ("\ufffd" for lone bytes): a dict keeps one
        assert all(v <= 0 for v in top.values())
        # greedy: the best of the top entries is the chosen token's logprob
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5), (i, top, chosen)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
