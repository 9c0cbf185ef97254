"""Structured output: grammar specs compiled by llguidance, per-request constraints, batch token masks."""

from engine.structured.compiler import GrammarCompiler, GrammarError
from engine.structured.constraint import RequestConstraint
from engine.structured.spec import GrammarSpec, Reasoning, lark_json, lark_literal, lark_token

__all__ = ["GrammarCompiler", "GrammarError", "GrammarSpec", "Reasoning", "RequestConstraint", "lark_json",
           "lark_literal", "lark_token"]
