"""The MTP layer kept in step with the engine (`mtp_drafts`): through chunked prefills and decode steps of
several requests at once, each draft equals the MTP layer run once over the request's whole history (its
hidden states from a plain prefill), and the counts of drafts proposed and right follow from them."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.batch import ForwardBatch, SeqSpan
from engine.sequence import Sequence
from tests.engine.conftest import random_prompt
from tests.engine.test_mtp import PROMPT_LEN, engine_mtp

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def snapshot(tiny_dir):
    return tiny_dir("bf16", num_nextn_predict_layers=1)


def standalone_drafts(snapshot, ids: list[int]) -> list[int]:
    """Row p: the MTP layer's draft for position p + 2, from a plain prefill's hidden states."""
    hidden = LLM(snapshot, dtype="float32", prefix_cache=False).layer_outputs(ids)[-1].mean(dim=1)
    layer, caches, _ = engine_mtp(snapshot, torch.float32)
    assert len(ids) - 1 <= PROMPT_LEN + 8  # within the helper's pages
    pages = list(range(caches[1].num_pages))
    batch = ForwardBatch(torch.tensor(ids[1:]), [SeqSpan(0, len(ids) - 1, 0, 0, pages)])
    return layer.logits(layer(hidden[:-1], batch, *caches)).argmax(dim=-1).tolist()


def test_drafts_equal_the_mtp_layer_over_the_whole_history(snapshot):
    llm = LLM(snapshot, dtype="float32", prefix_cache=False, mtp_drafts=True, max_num_batched_tokens=16,
              max_num_seqs=3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(str(i), random_prompt(length, seed=i), params) for i, length in enumerate((40, 23, 31))]
    drafts: dict[Sequence, dict[int, int]] = {seq: {} for seq in seqs}
    for seq in seqs:
        llm.core.add(seq)
    while llm.core.has_work:
        llm.core.step()
        for seq in seqs:
            if seq.draft_tokens:
                drafts[seq][seq.num_tokens] = seq.draft_tokens[0]  # its draft of the next position
    proposed = accepted = 0
    for seq in seqs:
        ids = seq.token_ids
        expected = standalone_drafts(snapshot, ids)
        assert len(drafts[seq]) == NEW_TOKENS - 1  # one after each sampled token but the last
        for position, token in drafts[seq].items():
            assert token == expected[position - 2], (seq.request_id, position)
            if position < len(ids):
                proposed += 1
                accepted += ids[position] == token
    stats = llm.core.stats().drafts
    assert (stats.proposed, stats.accepted) == (proposed, accepted) and proposed == 3 * (NEW_TOKENS - 1)


def test_drafts_stay_off_where_the_mtp_layer_cannot_run(snapshot, tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="glmflash.engine"):
        assert LLM(tiny_dir("bf16"), dtype="float32", prefix_cache=False, mtp_drafts=True).core.drafter is None
        assert "reason=no_mtp_layer" in caplog.text
    assert LLM(snapshot, dtype="float32", prefix_cache=False).core.stats().drafts is None
