"""Chat-template rendering, compatible with transformers' ``apply_chat_template``.

Only jinja2 is used (no transformers import), but the environment is built the
way transformers builds it, so a template renders to the same string:

* ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
  the ``loopcontrols`` extension;
* the ``tojson`` filter replaced by transformers' variant (``json.dumps`` with
  ``ensure_ascii=False`` by default; ``indent``, ``separators``, ``sort_keys``);
* globals ``raise_exception`` (a template's own error -> :class:`TemplateError`),
  ``strftime_now``, a ``dict`` constructor and an underscore-guarded ``namespace``;
* variables ``messages``, ``tools``, ``documents`` (None),
  ``add_generation_prompt``, the named special tokens from the snapshot
  (``bos_token``, ``eos_token``, ``pad_token``, ...) and the caller's keyword
  arguments (the request's ``chat_template_kwargs``, e.g. ``enable_thinking``),
  which override special tokens of the same name;
* message keys whose value is None are dropped, and a message's reasoning given
  as ``reasoning_content``, ``reasoning`` or ``thinking`` is exposed under
  ``reasoning_content`` and ``thinking`` (transformers >= 5 does both).

Before rendering, messages are normalised the way vLLM does for GLM:

* a ``content`` list of text parts is joined into one string (the parts are
  concatenated with no separator, which is how GLM's own templates render a
  parts list, so the prompt equals the one the template makes from the list;
  vLLM's "string" content format would join them with ``"\\n"``);
* a ``content`` list with images stays a list of ``{"type": "text", "text"}``
  and ``{"type": "image"}`` parts in order (vLLM's "openai" content format, as
  HF processors and GLM-4.xV templates expect): the template writes one image
  placeholder per image, which the server then expands to the image's tokens;
* an assistant tool call's ``function.arguments`` JSON string is decoded into a
  dict (GLM templates iterate over ``arguments.items()``); an empty/None value
  becomes ``{}``.

Template sources, as transformers loads them from a snapshot directory:
``chat_template.jinja`` (plus named templates in ``additional_chat_templates/``)
wins over ``tokenizer_config.json["chat_template"]``, which is a string or a list
of ``{"name", "template"}``; with several templates, ``tool_use`` is used when
tools are given and present, ``default`` otherwise.

Render errors caused by the request (the template's ``raise_exception``, an
undefined attribute, bad tool-call arguments, ...) raise :class:`TemplateError`,
which the server maps to HTTP 400.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "CHAT_TEMPLATE_DIR",
    "SPECIAL_TOKEN_NAMES",
    "ChatTemplate",
    "RenderedPrompt",
    "TemplateError",
    "normalize_messages",
    "prompt_ends_in_reasoning",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: passed to every template that has them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The chat template could not render this request (maps to HTTP 400)."""


class RenderedPrompt(str):
    """A rendered prompt (a ``str``) that knows whether it ends inside reasoning."""

    think_start: str = "<think>"

    @property
    def ends_in_reasoning(self) -> bool:
        """True when the prompt ends with an open ``<think>`` (the model continues reasoning)."""
        return prompt_ends_in_reasoning(self, self.think_start)


def prompt_ends_in_reasoning(prompt: str, think_start: str = "<think>") -> bool:
    """Whether ``prompt`` ends with ``think_start`` (ignoring trailing whitespace)."""
    return prompt.rstrip().endswith(think_start)


# ---------------------------------------------------------------------------
# The jinja2 environment (mirrors transformers.utils.chat_template_utils)
# ---------------------------------------------------------------------------


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by the template's own ``raise_exception``."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - transformers' signature
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# ---------------------------------------------------------------------------
# Input normalisation
# ---------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types (what the sandbox gets to see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models (ours, the openai SDK's)
        return _plain(value.model_dump(exclude_none=True))
    return f"<{type(value).__name__}>"


def _content(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with images, ``text`` and ``image`` parts in order."""
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif isinstance(part, Mapping) and part.get("type") in ("image_url", "image"):
            # What HF's and GLM-4.xV's templates test for; the image itself goes to the engine, not the template.
            parts.append({"type": "image"})
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"{where}.content[{i}]: unsupported content part {kind!r}; only text and images "
                                "are supported")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _decode_arguments(arguments: Any, where: str) -> Any:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise TemplateError(f"{where}: arguments is not valid JSON ({exc.msg})") from None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as the template sees them (see the module docstring); never mutates the input."""
    if not isinstance(messages, (list, tuple)):
        raise TemplateError("messages must be a list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        message = _plain(message)
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError(f"{where} must be an object")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = _content(content, where)
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # transformers' _alias_reasoning_fields
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        tool_calls = message.get("tool_calls")
        if isinstance(tool_calls, list):
            for j, call in enumerate(tool_calls):
                if not isinstance(call, dict):
                    continue
                fn = call.get("function") if isinstance(call.get("function"), dict) else call
                if "arguments" in fn or "name" in fn:
                    fn["arguments"] = _decode_arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function")
        out.append(message)
    return out


def _special_token_value(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]  # serialized AddedToken
    return None


# ---------------------------------------------------------------------------
# ChatTemplate
# ---------------------------------------------------------------------------


class ChatTemplate:
    """A snapshot's chat template(s), compiled once, rendered per request."""

    def __init__(
        self,
        template: str | Mapping[str, str],
        *,
        special_tokens: Mapping[str, str] | None = None,
        think_start: str = "<think>",
    ) -> None:
        templates = {"default": template} if isinstance(template, str) else dict(template)
        if "default" not in templates:
            raise ValueError(f"no 'default' chat template among {sorted(templates)}")
        env = _make_environment()
        self._compiled: dict[str, jinja2.Template] = {}
        for name, source in templates.items():
            if not isinstance(source, str):
                raise ValueError(f"chat template {name!r} is not a string")
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template {name!r} does not compile: {exc}") from exc
        self.templates: dict[str, str] = templates
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.think_start = think_start

    # --- loading -------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | pathlib.Path, **kwargs: Any) -> "ChatTemplate":
        """Load from a snapshot directory, with transformers' precedence of template sources."""
        path = pathlib.Path(path)
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))

        templates: dict[str, str] = {}
        if (path / CHAT_TEMPLATE_FILE).is_file():
            templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        extra_dir = path / CHAT_TEMPLATE_DIR
        if extra_dir.is_dir():
            for file in sorted(extra_dir.glob("*.jinja")):
                templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
        if not templates:
            source = config.get("chat_template")
            if source is None and (path / "chat_template.json").is_file():  # processor-style snapshots
                source = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
            if isinstance(source, str):
                templates["default"] = source
            elif isinstance(source, list):
                templates = {item["name"]: item["template"] for item in source}
            elif isinstance(source, dict):
                templates = dict(source)
        if not templates:
            raise FileNotFoundError(f"no chat template in {path} ({CHAT_TEMPLATE_FILE} or tokenizer_config.json)")

        special_tokens: dict[str, str] = {}
        legacy_map = path / "special_tokens_map.json"
        legacy = json.loads(legacy_map.read_text(encoding="utf-8")) if legacy_map.is_file() else {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _special_token_value(config.get(name))
            if value is None:
                value = _special_token_value(legacy.get(name))
            if value is not None:
                special_tokens[name] = value
        return cls(templates, special_tokens=special_tokens, **kwargs)

    # --- rendering -----------------------------------------------------------

    def template_name(self, tools: Any = None) -> str:
        """The template used: ``tool_use`` when tools are given and it exists, else ``default``."""
        return "tool_use" if tools is not None and "tool_use" in self._compiled else "default"

    @property
    def source(self) -> str:
        """The default template's text."""
        return self.templates["default"]

    def render(
        self,
        messages: Any,
        /,
        tools: Any = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> RenderedPrompt:
        """Render ``messages`` (dicts or pydantic models) into the prompt text.

        ``kwargs`` are the request's ``chat_template_kwargs`` (``enable_thinking``, ...).
        Raises :class:`TemplateError` when the request cannot be rendered.
        """
        reserved = _RESERVED_VARIABLES.intersection(kwargs)
        if reserved:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
        plain_messages = normalize_messages(messages)
        plain_tools = None
        if tools is not None:
            plain_tools = _plain(tools)
            if not isinstance(plain_tools, list) or not all(isinstance(t, dict) for t in plain_tools):
                raise TemplateError("tools must be a list of objects")
        variables = {**self.special_tokens, **_plain(kwargs)}
        template = self._compiled[self.template_name(tools)]
        try:
            text = template.render(
                messages=plain_messages,
                tools=plain_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as exc:
            raise TemplateError(exc.message or "the chat template rejected the request") from None
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"chat template error: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            raise TemplateError(f"chat template error: {type(exc).__name__}: {exc}") from None
        prompt = RenderedPrompt(text)
        prompt.think_start = self.think_start
        return prompt

    def ends_in_reasoning(self, prompt: str) -> bool:
        """Whether a prompt rendered by this template leaves the model inside ``<think>``."""
        return prompt_ends_in_reasoning(prompt, self.think_start)
