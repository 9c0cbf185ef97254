"""Structured output in the engine: bit packing, the compiler, one request's constraint, the batch masks
applied to real logits, and whole generations of the random tiny model checked with jsonschema / re."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.structured import GrammarCompiler, GrammarError, GrammarSpec, Reasoning, RequestConstraint
from engine.structured.constraint import pack_mask, token_mask
from engine.structured.masks import GrammarMasks
from engine.tiny.tokenizer import TOKEN_IDS, build_tokenizer

VOCAB = 320  # the tiny model's logits width (tokenizer: 283)
EOS = [256, 263, 265]
END_THINK = TOKEN_IDS["</think>"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                                        "maxLength": 4}},
                   "required": ["ok", "note"], "additionalProperties": False},
        "level": {"enum": [1, 2, 3]},
    },
    "required": ["name", "age", "tags", "nested"],
    "additionalProperties": False,
}


def unpack(words: torch.Tensor, vocab: int = VOCAB) -> np.ndarray:
    """Reference unpacking of an int32 bitmask, in numpy: bool [vocab]."""
    raw = words.numpy().astype(np.uint32)
    return np.array([(raw[t // 32] >> np.uint32(t % 32)) & 1 for t in range(vocab)], dtype=bool)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(build_tokenizer(), VOCAB, EOS)


def reference_mask(matcher) -> np.ndarray:
    """llguidance's own single-matcher mask (bytes, little-endian words)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    return unpack(words)


def assert_rows_masked(masked: torch.Tensor, original: torch.Tensor, allowed: dict[int, np.ndarray]) -> None:
    """Each row in `allowed` keeps exactly its allowed logits and has -inf elsewhere; every other row is untouched."""
    for row in range(original.shape[0]):
        if row not in allowed:
            assert torch.equal(masked[row], original[row]), f"free row {row} was masked"
            continue
        keep = torch.from_numpy(allowed[row])
        assert torch.equal(masked[row][keep], original[row][keep]), f"row {row} lost allowed tokens"
        assert torch.isneginf(masked[row][~keep]).all(), f"row {row} let disallowed tokens through"


def test_pack_mask_round_trips_every_bit():
    allowed = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[31] = allowed[63] = True  # the sign bits of two words
    packed = pack_mask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (10,)
    assert (unpack(packed) == allowed.numpy()).all()
    assert unpack(token_mask(VOCAB, [5, 300], allowed=True)).nonzero()[0].tolist() == [5, 300]
    assert (~unpack(token_mask(VOCAB, EOS, allowed=False))).nonzero()[0].tolist() == EOS


def test_compiler_kinds_and_errors(compiler):
    matcher = compiler.matcher(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"const": 1}},
                                                        "required": ["a"]}))
    forced = matcher.compute_ff_tokens()
    assert bytes(forced).decode().startswith('{"a": 1')  # byte tokens are their bytes; compact, json.dumps separators
    for spec in (GrammarSpec("regex", "[0-9]{3}"), GrammarSpec.choice(["yes", "no"]),
                 GrammarSpec("grammar", 'root ::= "x" [0-9]'), GrammarSpec("grammar", 'start: "x" /[0-9]/')):
        assert not compiler.matcher(spec).is_error()
    with pytest.raises(GrammarError, match="Invalid type"):
        compiler.matcher(GrammarSpec.json_schema({"type": "foo"}))
    with pytest.raises(GrammarError, match="unclosed group"):
        compiler.matcher(GrammarSpec("regex", "a(b"))
    with pytest.raises(GrammarError, match="/nope"):
        compiler.matcher(GrammarSpec.json_schema({"$ref": "#/nope"}))


def test_compiled_grammars_are_shared_but_matchers_are_not(compiler):
    spec = GrammarSpec.choice(["ab", "cd"])
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert first.consume_token(ord("a"))
    assert reference_mask(first).nonzero()[0].tolist() == [ord("b")]
    assert reference_mask(second).nonzero()[0].tolist() == [ord("a"), ord("c")]


def test_reasoning_phase_then_grammar(compiler):
    constraint = RequestConstraint("r", VOCAB, compiler.matcher(GrammarSpec.choice(["ok"])), Reasoning(END_THINK, 2),
                                   EOS)
    assert constraint.active and constraint.in_reasoning
    assert (~unpack(constraint.fixed_mask)).nonzero()[0].tolist() == EOS  # may not stop while reasoning
    constraint.accept(ord("x"))
    constraint.accept(ord("y"))
    assert unpack(constraint.fixed_mask).nonzero()[0].tolist() == [END_THINK]  # budget spent
    constraint.accept(END_THINK)
    assert not constraint.in_reasoning and constraint.fixed_mask is None
    assert reference_mask(constraint.matcher).nonzero()[0].tolist() == [ord("o")]


def test_reasoning_that_ends_early_and_budget_only_constraints():
    early = RequestConstraint("r", VOCAB, None, Reasoning(END_THINK, 5), EOS)
    assert not early.active  # no grammar: free until the budget is spent
    early.accept(END_THINK)
    assert not early.in_reasoning and not early.active
    zero = RequestConstraint("r", VOCAB, None, Reasoning(END_THINK, 0), EOS)
    assert zero.active and unpack(zero.fixed_mask).nonzero()[0].tolist() == [END_THINK]


def test_batch_masks_match_the_library_and_leave_free_rows_alone(compiler):
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(4)]
    seqs[0].constraint = RequestConstraint("0", VOCAB, compiler.matcher(GrammarSpec.json_schema(PERSON)), None, EOS)
    seqs[2].constraint = RequestConstraint("2", VOCAB, compiler.matcher(GrammarSpec("regex", "[a-c]+")), None, EOS)
    seqs[3].constraint = RequestConstraint("3", VOCAB, None, Reasoning(END_THINK, 0), EOS)
    masks = GrammarMasks(VOCAB, 8, torch.device("cpu"))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    pending = masks.start(seqs)
    assert pending.rows == [0, 2, 3]
    masks.apply(logits, pending)
    expected = {0: reference_mask(seqs[0].constraint.matcher), 2: reference_mask(seqs[2].constraint.matcher),
                3: unpack(token_mask(VOCAB, [END_THINK], allowed=True))}
    assert_rows_masked(logits, original, expected)
    assert masks.start([seqs[1]]) is None


@pytest.mark.parametrize("layout", ["FG", "GFG", "-RG-FG"])
def test_grammar_rows_after_fixed_rows_get_their_own_masks(compiler, layout):
    """Fixed (reasoning) rows are copied into the batch bitmask and grammar rows computed into it by llguidance:
    each grammar row's mask must land on its own row whatever fixed or free rows come before it (the test above
    has its fixed row last). `layout`, one row each: F a spent reasoning budget (only </think>), R reasoning
    before a grammar (anything but a stop), G the next of three different grammars, - a free row."""
    grammars = iter([GrammarSpec.json_schema(PERSON), GrammarSpec("regex", "[a-c]+"),
                     GrammarSpec.choice(["yes", "no"])])
    seqs, expected = [], {}
    for row, kind in enumerate(layout):
        seq = Sequence(str(row), [1], SamplingParams())
        if kind == "F":
            seq.constraint = RequestConstraint(seq.request_id, VOCAB, None, Reasoning(END_THINK, 0), EOS)
            expected[row] = np.arange(VOCAB) == END_THINK
        elif kind == "R":
            seq.constraint = RequestConstraint(seq.request_id, VOCAB, compiler.matcher(GrammarSpec.choice(["A"])),
                                               Reasoning(END_THINK, 4), EOS)
            expected[row] = ~np.isin(np.arange(VOCAB), EOS)
        elif kind == "G":
            seq.constraint = RequestConstraint(seq.request_id, VOCAB, compiler.matcher(next(grammars)), None, EOS)
            expected[row] = reference_mask(seq.constraint.matcher)
        seqs.append(seq)
    assert len({allowed.tobytes() for allowed in expected.values()}) == len(expected)  # a swap would show
    masks = GrammarMasks(VOCAB, 8, torch.device("cpu"))
    logits = torch.randn(len(layout), VOCAB, generator=torch.Generator().manual_seed(2))
    original = logits.clone()
    pending = masks.start(seqs)
    assert pending.rows == sorted(expected)
    masks.apply(logits, pending)
    assert_rows_masked(logits, original, expected)


def library_masks_along(matcher, drafts: list[int]) -> list[np.ndarray]:
    """llguidance's single-matcher masks before and after each draft, consumed one by one, then rolled back."""
    out = [reference_mask(matcher)]
    for token in drafts:
        assert matcher.consume_token(token)
        out.append(reference_mask(matcher))
    matcher.rollback(len(drafts))
    return out


def test_draft_rows_are_masked_along_the_drafts(compiler):
    """A verify's rows: each masks the token after the drafts before it (the grammar stepped along them and back),
    through the reasoning phase into the grammar; rows after a draft its row disallows are left free."""
    ab = ord("a"), ord("b")
    grammar = Sequence("g", [1], SamplingParams())
    grammar.constraint = RequestConstraint("g", VOCAB, compiler.matcher(GrammarSpec("regex", "ab[cd]e")), None, EOS)
    bad = Sequence("x", [1], SamplingParams())  # its second draft is outside the grammar
    bad.constraint = RequestConstraint("x", VOCAB, compiler.matcher(GrammarSpec("regex", "ab[cd]e")), None, EOS)
    thinking = Sequence("t", [1], SamplingParams())  # reasoning, its end, then the grammar
    thinking.constraint = RequestConstraint("t", VOCAB, compiler.matcher(GrammarSpec.choice(["ok"])),
                                            Reasoning(END_THINK, 4), EOS)
    spent = Sequence("s", [1], SamplingParams())  # a budget of one: the second row allows only the end
    spent.constraint = RequestConstraint("s", VOCAB, None, Reasoning(END_THINK, 1), EOS)
    free = Sequence("f", [1], SamplingParams())
    seqs = [grammar, free, bad, thinking, spent]
    drafts = [(grammar, ab), (bad, (ab[0], ord("x"), ord("c"))), (thinking, (ord("z"), END_THINK, ord("o"))),
              (spent, (ord("z"), ord("y")))]
    masks = GrammarMasks(VOCAB, 16, torch.device("cpu"))
    logits = torch.randn(5 + 2 + 3 + 3 + 2, VOCAB, generator=torch.Generator().manual_seed(3))
    original = logits.clone()
    along = library_masks_along(grammar.constraint.matcher, list(ab))
    no_stop = ~np.isin(np.arange(VOCAB), EOS)
    expected = {0: along[0], 5: along[1], 6: along[2],  # grammar: its row, then its two draft rows
                2: along[0], 7: along[1],  # bad: 'x' is not allowed after 'a': the rows after it stay free
                3: no_stop, 10: no_stop, 11: reference_mask(thinking.constraint.matcher),
                12: library_masks_along(thinking.constraint.matcher, [ord("o")])[1],
                13: np.arange(VOCAB) == END_THINK}  # spent: free (no grammar), then only the end: 'y' is not it
    # Started after the expected masks: the fill runs on a thread of its own, and a matcher serves one at a time.
    masks.apply(logits, masks.start(seqs, drafts))
    for row in (4, 8, 9, 14):  # free rows of verifying requests, and rows past a disallowed draft: every logit kept
        expected[row] = np.ones(VOCAB, dtype=bool)
    assert_rows_masked(logits, original, expected)
    assert reference_mask(grammar.constraint.matcher).nonzero()[0].tolist() == [ab[0]]  # stepped back


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(model=tiny_dir("bf16"), device="cpu", dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir("bf16") / "tokenizer.json"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_generation_validates_against_the_schema(llm, tokenizer, temperature):
    prompts = [list(f"prompt {i}".encode()) for i in range(8)]
    params = SamplingParams(max_tokens=160, temperature=temperature, seed=None if temperature == 0 else 7,
                            grammar=GrammarSpec.json_schema(PERSON))
    outputs = llm.generate(prompts, params)
    for out in outputs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in EOS
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), PERSON)
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # the prompts steer a real model, not a script


def test_regex_and_choice_generations(llm, tokenizer):
    prompts = [list(f"p{i}".encode()) for i in range(8)]
    regex = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=GrammarSpec("regex", r"[a-f]{2,5}-[0-9]{3}"))
    choice = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=GrammarSpec.choice(["yes", "no", "ná"]))
    for out in llm.generate(prompts, regex):
        assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", tokenizer.decode(out.token_ids)), out
    for out in llm.generate(prompts, choice):
        assert tokenizer.decode(out.token_ids) in ("yes", "no", "ná")


def test_greedy_under_a_mask_is_the_argmax_of_the_allowed_logits(llm, compiler):
    prompt = list(b"hello")
    logits = llm.prompt_logits(prompt)[-1]
    free_choice = int(logits.argmax())
    spec = GrammarSpec("regex", "[0-9]+" if not chr(free_choice).isdigit() else "[a-z]+")  # excludes the free choice
    allowed = torch.from_numpy(reference_mask(compiler.matcher(spec)))
    expected = int(torch.where(allowed, logits, float("-inf")).argmax())
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, grammar=spec))
    assert out.token_ids == [expected] and expected != free_choice


def test_reasoning_runs_to_its_budget_then_the_grammar(llm, tokenizer):
    prompts = [list(f"think {i}".encode()) for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=GrammarSpec.choice(["A", "B"]),
                            reasoning=Reasoning(END_THINK, 12))
    for out in llm.generate(prompts, params):
        end = out.token_ids.index(END_THINK)
        assert end <= 12 and not set(out.token_ids[:end]) & set(EOS)  # no stop while reasoning
        assert tokenizer.decode(out.token_ids[end + 1:]) in ("A", "B") and out.finish_reason == "stop"
