"""Which request fields ``/v1/completions`` and ``/v1/chat/completions`` take, and what
happens to the others.

Four kinds of field::

    honoured     carpool does what it asks (completion_params.py reads it)
    harmless     OpenAI's or vLLM's, changes nothing carpool writes (user, metadata, store,
                 ...): taken and ignored, silently
    unsupported  OpenAI's or vLLM's, asks for what carpool cannot do (tools, a json_schema
                 response_format, best_of > 1, ...): a 400 naming it, unless its value is
                 the one that means "not used" (tools: [], response_format: text, ...)
    unknown      neither OpenAI's nor vLLM's: ignored, with one warning log per field name
                 and carpool_openai_ignored_fields_total{field} counted, as vLLM ignores
                 them; a 400 naming it under ``carpool serve --strict-openai``
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from carpool.server.openai import BadParam

log = logging.getLogger("carpool.server.openai")

# Field names are the client's: past this many, the others are counted under one label.
MAX_FIELD_NAMES = 64
OTHER_FIELDS = "(others)"

_SAMPLING = (
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
    "stream", "stream_options", "priority", "ignore_eos", "stop_token_ids", "logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens",
    "return_tokens_as_token_ids",
)  # fmt: skip
COMPLETION_FIELDS = (*_SAMPLING, "prompt", "echo")
CHAT_FIELDS = (*_SAMPLING, "messages", "max_completion_tokens", "top_logprobs", "echo")

# Changing nothing carpool writes: user and bookkeeping fields, and vLLM's defaults
# that carpool follows anyway (``include_reasoning``: carpool parses no reasoning out of an
# answer, so there is none to include or leave out).
HARMLESS = frozenset(
    {
        "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
        "request_id", "cache_salt", "spaces_between_special_tokens", "kv_transfer_params",
        "vllm_xargs", "mm_processor_kwargs", "include_reasoning",
    }
)  # fmt: skip

# OpenAI's or vLLM's, not done by carpool: the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),  # plain text: what carpool writes anyway
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "chat_template": (None,),
    "continue_final_message": (None, False),
    "prompt_embeds": (None,),
    "return_token_ids": (None, False),
    "add_generation_prompt": (None, True),  # carpool's chat always opens the answer
    "documents": (None, []),
    "chat_template_kwargs": (None, {}),
}


class IgnoredFields:
    """The server's policy for unknown fields, and its count of those it ignored.

    ``strict``: refuse them (a 400 naming the first), as carpool did before it ignored them.
    Counting is thread-safe: the server's workers and a scrape may read it together."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        """Requests that carried each ignored field, by field name."""
        with self._lock:
            return dict(self._counts)

    def check(self, doc: dict[str, Any], known: tuple[str, ...]) -> None:
        """Refuse what ``doc`` asks that carpool cannot do; ignore (or, when ``strict``,
        refuse) the fields no one defines.

        Raises:
            BadParam: naming the field.
        """
        for name, unused in UNSUPPORTED.items():
            if name in doc and not is_unused(doc[name], unused):
                raise BadParam(
                    name, f"{name}={doc[name]!r} is not supported by carpool; leave {name} out"
                )
        unknown = sorted(set(doc) - set(known) - HARMLESS - set(UNSUPPORTED))
        if unknown and self.strict:
            raise BadParam(
                unknown[0],
                f"unknown field {unknown[0]!r} (refused under --strict-openai); expected "
                f"{sorted({*known, *HARMLESS, *UNSUPPORTED})}",
            )
        for name in unknown:
            self._ignore(name)

    def _ignore(self, name: str) -> None:
        with self._lock:
            is_first = name not in self._counts
            if is_first and len(self._counts) >= MAX_FIELD_NAMES:
                name, is_first = OTHER_FIELDS, False
            self._counts[name] = self._counts.get(name, 0) + 1
        if is_first:
            log.warning(
                "ignored the request field %r, which neither OpenAI nor vLLM defines (logged "
                "once; counted in carpool_openai_ignored_fields_total; carpool serve "
                "--strict-openai refuses it)",
                name,
            )


def is_unused(value: Any, unused: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the "not used" values, by type too: ``0`` is not
    ``False``."""
    return any(value is u or (type(value) is type(u) and value == u) for u in unused)
