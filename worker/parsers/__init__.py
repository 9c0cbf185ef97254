"""Model-output parsers, chosen by name like vLLM's ``--reasoning-parser`` / ``--tool-call-parser``.

Per request the server builds ``REASONING_PARSERS[name](starts_in_reasoning=...)``
and, when the request has tools, ``TOOL_PARSERS[name](tools=...)``; it feeds the
reasoning parser the decoded output and the tool parser the content that comes
out of it.  ``glm45`` covers GLM-4.5/4.6/4.7/5; ``glm47`` is an alias so that
vLLM's GLM-4.7/5 flag (``--tool-call-parser glm47``) works unchanged.
"""

from worker.parsers.reasoning import GlmReasoningParser, ReasoningDelta
from worker.parsers.tool_calls import GlmToolParser, ToolCall, ToolCallDelta, ToolStreamDelta

REASONING_PARSERS: dict[str, type[GlmReasoningParser]] = {"glm45": GlmReasoningParser}
TOOL_PARSERS: dict[str, type[GlmToolParser]] = {"glm45": GlmToolParser, "glm47": GlmToolParser}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "GlmReasoningParser",
    "GlmToolParser",
    "ReasoningDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolStreamDelta",
]
