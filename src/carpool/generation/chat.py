"""Chat messages → one prompt string, through the model's chat template.

A Hugging Face folder names its template in ``tokenizer_config.json`` (``chat_template``,
a Jinja template). It is rendered as ``transformers`` renders it: Jinja2's sandbox,
``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``bos_token``,
``eos_token`` and ``add_generation_prompt``, and the helpers ``raise_exception`` and
``strftime_now``. Jinja2 is imported only when a template is rendered (it comes with
torch and transformers).

A model without a template (the built-in random-weight model) gets :data:`FALLBACK`::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

"""

from __future__ import annotations

import datetime
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
    """One message: a role and its text."""

    role: str
    content: str

    @classmethod
    def from_json(cls, value: Any, index: int) -> ChatMessage:
        """A message from OpenAI's JSON: ``{"role": ..., "content": str | [parts]}``; text
        parts (``{"type": "text", "text": ...}``) are joined, other parts are refused.

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
            content = "".join(
                _text_part(part, f"{at}.content[{i}]") for i, part in enumerate(content)
            )
        if not isinstance(content, str):
            raise InvalidInput(
                f"{at}.content is a {type(content).__name__}; expected a string or a list of "
                "text parts"
            )
        return cls(role, content)


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
                messages=[{"role": m.role, "content": m.content} for m in messages],
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


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError(
            "chat_template", "<jinja>", "jinja2 installed (pip install jinja2) to render it"
        ) from None
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(template)
    except TemplateError as error:
        raise ConfigError(
            "chat_template", template[:60], f"a valid Jinja template ({error})"
        ) from None
