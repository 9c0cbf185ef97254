"""Structured output on CUDA: the bitmask applied on the device equals the CPU path, and constrained
generation through CUDA-graph decode validates and matches the eager engine (runs only where a GPU is)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from engine.structured import GrammarCompiler, GrammarSpec, Reasoning, RequestConstraint
from engine.structured.masks import GrammarMasks
from engine.tiny.factory import write_tiny_model
from engine.tiny.tokenizer import TOKEN_IDS, build_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


def test_device_masks_equal_the_cpu_masks():
    compiler = GrammarCompiler(build_tokenizer(), 320, [256, 263, 265])
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(5)]
    for i, spec in ((0, GrammarSpec.json_schema(SCHEMA)), (1, GrammarSpec("regex", "[a-z]{3}")),
                    (3, GrammarSpec.choice(["yes", "no"]))):
        seqs[i].constraint = RequestConstraint(str(i), 320, compiler.matcher(spec), None, [256])
    seqs[4].constraint = RequestConstraint("4", 320, None, Reasoning(TOKEN_IDS["</think>"], 0), [256])
    logits = torch.randn(5, 320, generator=torch.Generator().manual_seed(0))
    on_cpu, on_gpu = logits.clone(), logits.cuda()
    for masks, tensor in ((GrammarMasks(320, 8, torch.device("cpu")), on_cpu),
                          (GrammarMasks(320, 8, torch.device("cuda")), on_gpu)):
        masks.apply(tensor, masks.start(seqs))
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.isneginf(on_cpu[4]).sum() == 319 and torch.equal(on_cpu[2], logits[2])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("structured"), "nvfp4-ct")


def test_constrained_decode_through_graphs(snapshot):
    tokenizer = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    prompts = [list(f"prompt {i}".encode()) for i in range(16)]
    graphs = LLM(snapshot, "cuda", "bfloat16", max_num_seqs=16)
    eager = LLM(snapshot, "cuda", "bfloat16", max_num_seqs=16, cuda_graphs=False)
    assert graphs.runner.graphs is not None
    sampled = SamplingParams(max_tokens=120, temperature=1.0, grammar=GrammarSpec.json_schema(SCHEMA))
    for out in graphs.generate(prompts, sampled):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), SCHEMA)
    greedy = SamplingParams(max_tokens=120, temperature=0.0, grammar=GrammarSpec.json_schema(SCHEMA))
    assert [o.token_ids for o in graphs.generate(prompts[:4], greedy)] == \
        [o.token_ids for o in eager.generate(prompts[:4], greedy)]
