"""Pydantic v2 schemas for the OpenAI-compatible API (requests, responses, errors).

Kept apart from the HTTP handlers, like vLLM's ``protocol.py``: this module only
describes and validates the wire format.  It imports neither torch nor the engine.

Requests
    ``ChatCompletionRequest`` (``/v1/chat/completions``) and ``CompletionRequest``
    (``/v1/completions``).  Typed fields are validated with OpenAI's ranges;
    unknown fields are accepted and kept in ``model_extra`` (clients send vendor
    fields), never an error.  Parse with :func:`parse_request`, which raises
    :class:`ProtocolError` carrying an OpenAI error body whose ``param`` names the
    offending field (``"temperature"``, ``"messages[0].content"``,
    ``"tools[1].function.name"``, ...).

Responses
    ``ChatCompletionResponse``, ``ChatCompletionChunk``, ``CompletionResponse``,
    ``CompletionChunk``, ``Usage``, ``ModelList``/``ModelCard`` and the logprob
    shapes.  They serialize (``model_dump()`` / ``model_dump_json()``) like
    ``exclude_none=True`` except for the fields OpenAI always sends even when
    null (``choices[].logprobs``, a streamed ``finish_reason``, an assistant
    message's ``content`` next to ``tool_calls``, logprob ``bytes``, an error's
    ``param``/``code``); the official ``openai`` package parses the output.

Errors
    :func:`error_body` builds ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, TypeVar, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    # limits
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    # errors
    "ProtocolError",
    "ErrorInfo",
    "ErrorResponse",
    "error_body",
    "error_type_for_status",
    "validation_error_body",
    "protocol_error_from_validation",
    "parse_request",
    # request pieces
    "TextContentPart",
    "ImageURL",
    "ImageContentPart",
    "ChatMessageFunction",
    "ChatMessageToolCall",
    "ChatMessage",
    "FunctionDefinition",
    "ChatTool",
    "NamedToolChoiceFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "JsonSchemaFormat",
    "StructuredOutputs",
    "StructuredOutputRequest",
    "StreamOptions",
    "ChatCompletionRequest",
    "CompletionRequest",
    # response pieces
    "Usage",
    "PromptTokensDetails",
    "CompletionTokensDetails",
    "TopLogprob",
    "ChatCompletionTokenLogprob",
    "ChatCompletionLogprobs",
    "CompletionLogprobs",
    "FunctionCall",
    "ToolCall",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "ChatCompletionMessage",
    "DeltaMessage",
    "ChatCompletionChoice",
    "ChatCompletionResponse",
    "ChatCompletionChunkChoice",
    "ChatCompletionChunk",
    "CompletionChoice",
    "CompletionResponse",
    "CompletionChunk",
    "ModelCard",
    "ModelList",
    # helpers
    "random_id",
    "ChatFinishReason",
    "CompletionFinishReason",
]

MAX_N = 16  # most choices one request may ask for
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (and ours for completions' logprobs)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

ChatFinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
CompletionFinishReason = Literal["stop", "length", "content_filter"]

# Template variables that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

_STATUS_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_type_for_status(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    if status in _STATUS_ERROR_TYPES:
        return _STATUS_ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    type: str | None = None,  # noqa: A002 - OpenAI's field name
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``; ``type`` defaults from ``status``."""
    return {
        "error": {
            "message": message,
            "type": type or error_type_for_status(status),
            "param": param,
            "code": code,
        }
    }


class ProtocolError(Exception):
    """A request the API refuses; carries the HTTP status and the OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,  # noqa: A002
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or error_type_for_status(status)
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, type=self.type, code=self.code)


def _invalid(message: str, field: str | None = None, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error raised from our own validators.

    ``field`` is a path relative to where the validator runs (``"tool_call_id"``,
    ``"[2].type"``); it is appended to pydantic's location to build ``param``.
    """
    return PydanticCustomError("glmflash", "{message}", {"message": message, "field": field, "code": code})


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes", "tuple", "set"})


def _is_union_tag(segment: str) -> bool:
    """Location segments pydantic adds for union members (``str``, ``list[int]``, ``NamedToolChoice``)."""
    return segment in _TYPE_NAMES or "[" in segment or segment[:1].isupper() or segment.startswith("function-")


def _join_param(base: str, tail: str | None) -> str:
    if not tail:
        return base
    if tail.startswith("["):
        return base + tail
    return f"{base}.{tail}" if base else tail


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    param = ""
    for segment in loc:
        if isinstance(segment, int):
            param += f"[{segment}]"
        elif isinstance(segment, str) and not _is_union_tag(segment):
            param = _join_param(param, segment)
    return param


def _short_repr(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_TYPE_ERROR_SUFFIXES = ("_type", "_parsing", "_from_float")


def protocol_error_from_validation(exc: ValidationError) -> ProtocolError:
    """The first error of a pydantic ``ValidationError`` as an OpenAI 400 error."""
    errors = exc.errors(include_url=False)
    if not errors:
        return ProtocolError("Invalid request.")
    err = errors[0]
    ctx = err.get("ctx") or {}
    param = _loc_to_param(tuple(err.get("loc", ())))
    if err["type"] == "glmflash":
        param = _join_param(param, ctx.get("field"))
        code = ctx.get("code")
        detail = ctx["message"].rstrip(".") + "."
        if not param:
            return ProtocolError(f"Invalid request: {detail}", code=code)
        if code == "missing_required_parameter":
            return ProtocolError(f"Missing required parameter: '{param}' ({detail[:-1]}).", param=param, code=code)
        kind = "type" if code == "invalid_type" else "value"
        return ProtocolError(f"Invalid {kind} for '{param}': {detail}", param=param, code=code)
    if not param:
        if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
            return ProtocolError("The request body must be a JSON object.", code="invalid_type")
        return ProtocolError(f"Invalid request: {err['msg']}.")
    if err["type"] == "missing":
        return ProtocolError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    detail = err["msg"]
    if "input" in err and not isinstance(err["input"], (dict, list)):
        detail += f" (got {_short_repr(err['input'])})"
    if err["type"].endswith(_TYPE_ERROR_SUFFIXES):
        return ProtocolError(f"Invalid type for '{param}': {detail}.", param=param, code="invalid_type")
    return ProtocolError(f"Invalid value for '{param}': {detail}.", param=param, code="invalid_value")


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    """OpenAI error body (status 400) for a pydantic ``ValidationError``."""
    return protocol_error_from_validation(exc).body()


_M = TypeVar("_M", bound=BaseModel)


def parse_request(model_cls: type[_M], payload: Any) -> _M:
    """Validate a decoded JSON body; raises :class:`ProtocolError` (400) when invalid."""
    if not isinstance(payload, dict):
        raise ProtocolError("The request body must be a JSON object.", code="invalid_type")
    try:
        return model_cls.model_validate(payload)
    except ValidationError as exc:
        raise protocol_error_from_validation(exc) from None


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


class _RequestModel(BaseModel):
    """Request objects: typed fields validated, unknown fields kept (``model_extra``)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextContentPart(_RequestModel):
    type: Literal["text"] = "text"
    text: str


ImageDetail = Literal["auto", "low", "high"]


class ImageURL(_RequestModel):
    url: str  # a data: URL (base64) or an http(s) URL
    # OpenAI's resolution hint; accepted and ignored: the image processor's token budget decides the resolution.
    detail: ImageDetail | None = None


class ImageContentPart(_RequestModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


ContentPart = Annotated[Union[TextContentPart, ImageContentPart], Field(discriminator="type")]


def _check_content(value: Any) -> Any:
    """``content``: a string, or a list of text and image parts (checked here, so errors name the part)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _invalid("content must be a string or a list of content parts", code="invalid_type")
    for i, part in enumerate(value):
        if isinstance(part, (TextContentPart, ImageContentPart)):
            continue
        if not isinstance(part, dict):
            raise _invalid("each content part must be an object", f"[{i}]", code="invalid_type")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _invalid("a text content part needs a string 'text'", f"[{i}].text", code="invalid_type")
        elif kind == "image_url":
            _check_image_url(part.get("image_url"), f"[{i}].image_url")
        else:
            raise _invalid(f"content part type {_short_repr(kind)} is not supported; 'text' and 'image_url' parts "
                           "are accepted", f"[{i}].type")
    return value


def _check_image_url(value: Any, field: str) -> None:
    if isinstance(value, ImageURL):
        return
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise _invalid('an image_url content part needs "image_url": {"url": "..."}', field, code="invalid_type")
    if value.get("detail") is not None and value["detail"] not in get_args(ImageDetail):
        raise _invalid(f"detail must be one of {', '.join(map(repr, get_args(ImageDetail)))}", f"{field}.detail")


class ChatMessageFunction(_RequestModel):
    name: str
    # OpenAI sends a JSON string; a decoded object is accepted as well.
    arguments: Union[str, dict[str, Any]] = "{}"

    @field_validator("arguments", mode="before")
    @classmethod
    def _check_arguments(cls, value: Any) -> Any:
        if value is None:
            return "{}"
        if isinstance(value, dict):
            return value
        if not isinstance(value, str):
            raise _invalid("arguments must be a JSON object encoded as a string", code="invalid_type")
        if value.strip():
            try:
                decoded = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _invalid(f"arguments is not valid JSON ({exc.msg})") from None
            if not isinstance(decoded, dict):
                raise _invalid("arguments must encode a JSON object")
        return value

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments decoded into a dict (``{}`` for an empty string)."""
        if isinstance(self.arguments, dict):
            return self.arguments
        return json.loads(self.arguments) if self.arguments.strip() else {}


class ChatMessageToolCall(_RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ChatMessageFunction


class ChatMessage(_RequestModel):
    """One message of ``messages`` (system, developer, user, assistant or tool)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    # assistant
    tool_calls: list[ChatMessageToolCall] | None = None
    reasoning_content: str | None = None
    # tool
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _validate_content(cls, value: Any) -> Any:
        return _check_content(value)

    @field_validator("role", mode="before")
    @classmethod
    def _check_role(cls, value: Any) -> Any:
        if value not in ("system", "developer", "user", "assistant", "tool"):
            raise _invalid(
                f"unsupported role {_short_repr(value)}; expected one of 'system', 'developer', 'user', "
                "'assistant', 'tool'"
            )
        return value

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise _invalid(f"a {self.role} message needs 'content'", "content", code="missing_required_parameter")
        if self.role == "tool" and not self.tool_call_id:
            raise _invalid("a tool message needs 'tool_call_id'", "tool_call_id", code="missing_required_parameter")
        if self.tool_calls and self.role != "assistant":
            raise _invalid("only assistant messages may carry 'tool_calls'", "tool_calls")
        if self.role != "user" and isinstance(self.content, list):  # as in OpenAI's API: other roles send text
            for i, part in enumerate(self.content):
                if isinstance(part, ImageContentPart):
                    raise _invalid(f"image parts are only accepted in user messages, not in a {self.role} message",
                                   f"content[{i}]")
        return self

    def text(self) -> str | None:
        """``content`` as plain text (text parts concatenated, images left out)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))


class FunctionDefinition(_RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_RequestModel):
    name: str


class NamedToolChoice(_RequestModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(_RequestModel):
    """``response_format.json_schema``: the schema is always enforced (``strict`` or not, as in vLLM)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_RequestModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ("text", "json_object", "json_schema"):
            raise _invalid(f"response_format type {_short_repr(value)} is not supported; use 'text', "
                           "'json_object' or 'json_schema'")
        return value

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise _invalid("response_format of type 'json_schema' needs 'json_schema' with a 'schema'",
                           "json_schema", code="missing_required_parameter")
        return self


def _json_schema_value(value: Any) -> Any:
    """A JSON schema given as an object or as its JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _invalid(f"the schema is not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise _invalid("a JSON schema must be a JSON object", code="invalid_type")
    return value


def _choice_value(value: Any) -> Any:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _invalid("choices must be a non-empty list of strings", code="invalid_type")
    return value


class StructuredOutputs(_RequestModel):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""

    json_: dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None

    @field_validator("json_", mode="before")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        return None if value is None else _json_schema_value(value)

    @field_validator("choice", mode="before")
    @classmethod
    def _choices(cls, value: Any) -> Any:
        return None if value is None else _choice_value(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        if self.structural_tag is not None:
            raise _invalid("structural_tag is not supported", "structural_tag")
        given = [name for name in ("json", "regex", "choice", "grammar") if self.constraint_value(name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise _invalid("structured_outputs must set exactly one of 'json', 'regex', 'choice', 'grammar', "
                           f"'json_object' (got {', '.join(given) or 'none'})")
        return self

    def constraint_value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)


class StructuredOutputRequest(NamedTuple):
    """The one structured-output constraint of a request: where it came from (named in errors), its kind
    (``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its value."""

    param: str
    kind: str
    value: Any


class StreamOptions(_RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage on every chunk


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise _invalid("stop sequences must be strings", f"[{i}]", code="invalid_type")
        return value
    raise _invalid("stop must be a string or a list of strings", code="invalid_type")


class _SamplingRequest(_RequestModel):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None: the served model
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: disabled
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json", mode="before")
    @classmethod
    def _guided_schema(cls, value: Any) -> Any:
        return None if value is None else _json_schema_value(value)

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _guided_choices(cls, value: Any) -> Any:
        return None if value is None else _choice_value(value)

    @field_validator("stop", mode="before")
    @classmethod
    def _validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        for i, token_id in enumerate(value or ()):
            if token_id < 0:
                raise _invalid("token ids must be >= 0", f"[{i}]")
        return value

    @field_validator("n", "stream", "ignore_eos", "skip_special_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        # Clients send explicit nulls for fields they leave unset.
        if value is None:
            return cls.model_fields[info.field_name].default
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise _invalid("stream_options is only allowed when stream is true", "stream_options")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self):
        given = [field for field in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                     "guided_choice", "guided_grammar") if self._constraint_field(field)]
        if len(given) > 1:
            raise _invalid(f"only one structured-output constraint may be given, got {' and '.join(given)}",
                           given[1])
        return self

    def _constraint_field(self, field: str) -> bool:
        value = getattr(self, field)
        return value is not None and not (field == "response_format" and value.type == "text")

    @property
    def structured_output(self) -> StructuredOutputRequest | None:
        """The request's structured-output constraint, from whichever field carries it."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputRequest("response_format", "json_object", True)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputRequest("response_format.json_schema.schema", "json_schema", fmt.json_schema.schema_)
        so = self.structured_outputs
        if so is not None:
            if so.json_object:
                return StructuredOutputRequest("structured_outputs.json_object", "json_object", True)
            name = next(n for n in ("json", "regex", "choice", "grammar") if so.constraint_value(n) is not None)
            kind = "json_schema" if name == "json" else name
            return StructuredOutputRequest(f"structured_outputs.{name}", kind, so.constraint_value(name))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                return StructuredOutputRequest(f"guided_{kind}", "json_schema" if kind == "json" else kind, value)
        return None

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` as a list, empty strings dropped."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        """Streaming: send a final chunk with ``usage``."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Newer OpenAI clients send max_completion_tokens; it wins over max_tokens.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: reasoning tokens after which </think> is forced (-1: no limit).
    thinking_token_budget: int | None = Field(default=None, ge=-1)

    @field_validator("messages", mode="before")
    @classmethod
    def _check_messages(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise _invalid("messages must contain at least one message", code="invalid_value")
        return value

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_logprobs(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or isinstance(value, NamedToolChoice):
            return value
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise _invalid(
                    f"{_short_repr(value)} is not one of 'none', 'auto', 'required' or a named function "
                    '({"type": "function", "function": {"name": ...}})'
                )
            return value
        if isinstance(value, dict):
            if value.get("type", "function") != "function":
                raise _invalid("only function tools are supported", "type")
            fn = value.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _invalid("a named tool_choice needs function.name", "function.name",
                               code="missing_required_parameter")
            return value
        raise _invalid("tool_choice must be 'none', 'auto', 'required' or a named function", code="invalid_type")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in value or ():
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise _invalid(f"{key!r} is set by the server and cannot be passed in chat_template_kwargs", key)
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise _invalid("tool_choice 'required' or a named function requires 'tools'", "tool_choice")
            if self.structured_output is not None:
                raise _invalid(f"tool_choice 'required' or a named function constrains the output to tool calls; "
                               f"it cannot be combined with {self.structured_output.param.split('.')[0]}",
                               "tool_choice")
            if isinstance(choice, NamedToolChoice):
                names = {tool.function.name for tool in self.tools}
                if choice.function.name not in names:
                    raise _invalid(
                        f"function {choice.function.name!r} is not among the tools", "tool_choice.function.name"
                    )
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``; None: up to the context limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def enable_thinking(self) -> bool | None:
        """``chat_template_kwargs.enable_thinking`` when given."""
        if self.chat_template_kwargs and "enable_thinking" in self.chat_template_kwargs:
            return bool(self.chat_template_kwargs["enable_thinking"])
        return None

    def template_messages(self) -> list[dict[str, Any]]:
        """``messages`` as plain dicts (unset/None fields dropped) for the chat template."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as plain dicts for the chat template (None when absent)."""
        if self.tools is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _check_prompt(value: Any) -> Any:
    """str | list[str] | list[int] | list[list[int]], non-empty."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _invalid(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            code="invalid_type",
        )
    if not value:
        raise _invalid("prompt must not be empty")
    if all(isinstance(x, str) for x in value):
        return value
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        for i, token_id in enumerate(value):
            if token_id < 0:
                raise _invalid("token ids must be >= 0", f"[{i}]")
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not ids:
                raise _invalid("a token-id prompt must not be empty", f"[{i}]")
            for j, token_id in enumerate(ids):
                if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                    raise _invalid("token ids must be integers >= 0", f"[{i}][{j}]", code="invalid_type")
        return value
    raise _invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids "
        "(not a mixture)",
        code="invalid_type",
    )


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _validate_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _invalid("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _invalid("best_of is not supported; use n")
        return value

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_tokens``; None: the server's default (OpenAI's is 16)."""
        return self.max_tokens


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


class TokenizeRequest(_RequestModel):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` (with the chat completion's `tools` and
    `chat_template_kwargs`, rendered as /v1/chat/completions renders them). By default the ids are those this
    server's completions compute: no special tokens added beyond what the template writes."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # validated as a chat completion's
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise _invalid("give either prompt or messages", "prompt", code="missing_required_parameter")
        return self


class DetokenizeRequest(_RequestModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class _ResponseModel(BaseModel):
    """Serializes like ``exclude_none=True``, except fields in ``keep_none_fields``."""

    model_config = ConfigDict(extra="forbid")
    keep_none_fields: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        data = handler(self)
        if not isinstance(data, dict):
            return data
        keep = type(self).keep_none_fields
        return {k: v for k, v in data.items() if v is not None or k in keep}


class PromptTokensDetails(_ResponseModel):
    cached_tokens: int | None = None


class CompletionTokensDetails(_ResponseModel):
    reasoning_tokens: int | None = None


class Usage(_ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, *, cached_tokens: int | None = None,
           reasoning_tokens: int | None = None) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )


# --- logprobs ---------------------------------------------------------------


class TopLogprob(_ResponseModel):
    keep_none_fields = frozenset({"bytes"})
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(_ResponseModel):
    keep_none_fields = frozenset({"bytes"})
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(_ResponseModel):
    """Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    keep_none_fields = frozenset({"content"})
    content: list[ChatCompletionTokenLogprob] | None = None


class CompletionLogprobs(_ResponseModel):
    """Completions: parallel lists; with echo the first prompt token's logprob is null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# --- tool calls ---------------------------------------------------------------


class FunctionCall(_ResponseModel):
    name: str
    arguments: str  # JSON-encoded object


class ToolCall(_ResponseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_ResponseModel):
    """A streamed piece of a tool call; the first piece carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


# --- chat ---------------------------------------------------------------------


class ChatCompletionMessage(_ResponseModel):
    keep_none_fields = frozenset({"content"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaMessage(_ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChoice(_ResponseModel):
    keep_none_fields = frozenset({"logprobs"})
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: ChatFinishReason
    stop_reason: Union[int, str, None] = None  # vLLM extension: the stop string / token id that matched


class ChatCompletionResponse(_ResponseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatCompletionChunkChoice(_ResponseModel):
    keep_none_fields = frozenset({"logprobs", "finish_reason"})
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(_ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None  # only on the final usage chunk (stream_options.include_usage)
    system_fingerprint: str | None = None


# --- text completions -----------------------------------------------------------


class CompletionChoice(_ResponseModel):
    """A completion choice; ``finish_reason`` is null on streamed chunks until the last."""

    keep_none_fields = frozenset({"logprobs", "finish_reason"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(_ResponseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(_ResponseModel):
    """A streamed text completion event (OpenAI reuses the ``text_completion`` object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


# --- tokenize -----------------------------------------------------------------


class TokenizeResponse(_ResponseModel):
    keep_none_fields = frozenset({"token_strs"})
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_ResponseModel):
    prompt: str


# --- models -------------------------------------------------------------------


class ModelCard(_ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "glmflash"
    root: str | None = None
    max_model_len: int | None = None
    input_modalities: list[str] | None = None  # ["text"], or ["text", "image"] where chat takes images


class ModelList(_ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# --- errors ---------------------------------------------------------------------


class ErrorInfo(_ResponseModel):
    keep_none_fields = frozenset({"param", "code"})
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_ResponseModel):
    error: ErrorInfo
