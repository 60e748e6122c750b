"""Chat messages → one prompt string, through the model's chat template.

A Hugging Face folder names its template in ``tokenizer_config.json`` (``chat_template``,
a Jinja template). It is rendered as ``transformers`` renders it: Jinja2's sandbox,
``trim_blocks`` and ``lstrip_blocks``, ``{% break %}``/``{% continue %}``, the variables
``messages`` (each with ``role``, ``content`` and, when sent, ``name``), ``bos_token``,
``eos_token`` and ``add_generation_prompt``, the helpers ``raise_exception`` and
``strftime_now``, and transformers' ``tojson`` (non-ASCII and ``<``/``&`` kept as they
are; ``indent``, ``separators``, ``sort_keys``). Jinja2 is imported only when a template
is rendered (it comes with torch and transformers).

The built-in random-weight model (no template of its own) gets :data:`FALLBACK`::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from carpool.errors import ConfigError, InvalidInput

ROLES = ("system", "user", "assistant", "tool", "developer")

FALLBACK = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message: a role, its text, and the sender's ``name`` when given."""

    role: str
    content: str
    name: str | None = None

    @classmethod
    def from_json(cls, value: Any, index: int) -> ChatMessage:
        """A message from OpenAI's JSON: ``{"role": ..., "content": str | [parts],
        "name": str}``; text parts (``{"type": "text", "text": ...}``) are joined with a
        newline (as vLLM joins them), other parts are refused.

        Raises:
            InvalidInput: naming ``messages[index]`` and what was wrong.
        """
        at = f"messages[{index}]"
        if not isinstance(value, dict):
            raise InvalidInput(f"{at} is a {type(value).__name__}; expected an object")
        role = value.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{at}.role={role!r}: expected one of {list(ROLES)}")
        content = value.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = "\n".join(
                _text_part(part, f"{at}.content[{i}]") for i, part in enumerate(content)
            )
        if not isinstance(content, str):
            raise InvalidInput(
                f"{at}.content is a {type(content).__name__}; expected a string or a list of "
                "text parts"
            )
        name = value.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidInput(f"{at}.name is a {type(name).__name__}; expected a string")
        return cls(role, content, name)

    def as_template_data(self) -> dict[str, str]:
        """The message as a template sees it (``name`` only when given, as transformers
        drops keys that are None)."""
        data = {"role": self.role, "content": self.content}
        if self.name is not None:
            data["name"] = self.name
        return data


def _text_part(part: Any, at: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidInput(f"{at} is of type {kind!r}; this model takes text parts only")


def render_chat(
    messages: Sequence[ChatMessage],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages`` (``template`` None: :data:`FALLBACK`).

    Raises:
        InvalidInput: when the template refuses the conversation (``raise_exception``, e.g.
            roles that do not alternate) or fails while rendering.
        ConfigError: when the template does not compile, or Jinja2 is not installed.
    """
    if not messages:
        raise InvalidInput("messages is empty; expected at least one message")
    compiled = _compile(template if template is not None else FALLBACK)
    try:
        return str(
            compiled.render(
                messages=[m.as_template_data() for m in messages],
                bos_token=bos_token,
                eos_token=eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        )
    except _TemplateRefused as refused:
        raise InvalidInput(f"the model's chat template refused the messages: {refused}") from None
    except Exception as error:
        raise InvalidInput(
            f"the model's chat template failed on these messages ({type(error).__name__}: {error})"
        ) from None


class _TemplateRefused(Exception):
    """Raised by a template's ``raise_exception(message)``."""


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's escapes HTML characters)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError(
            "chat_template", "<jinja>", "jinja2 installed (pip install jinja2) to render it"
        ) from None
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise ConfigError(
            "chat_template", template[:60], f"a valid Jinja template ({error})"
        ) from None
