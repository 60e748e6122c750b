"""Text ↔ token ids for generation, and detokenization that streams.

Two tokenizers share one small interface (:class:`Tokenizer`):

- :class:`HFTokenizer`: a Hugging Face folder's ``tokenizer.json`` (the ``tokenizers``
  library), with BOS/EOS and the Jinja chat template read as ``transformers`` reads them
  (``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``);
- :class:`ByteTokenizer`: one id per byte (0-255) plus BOS (256) and EOS (257), for the
  built-in random-weight model; it needs no files.

Streaming text token by token is not decoding each token alone: a character may span
tokens (``"é"`` is the bytes ``C3 A9``, two byte-level tokens) and a word-piece's leading
space depends on its left neighbour. :class:`IncrementalDetokenizer` decodes a short
window of recent ids and holds back text that ends in a broken UTF-8 sequence (decoded as
U+FFFD) until the next token completes it::

    ids      ... 72  105 | 195 | 169  33
    window        "Hi"   | "Hi\\ufffd" (held) | "Hié!" → emits "é!"
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from carpool.errors import ConfigError, InvalidInput
from carpool.generation.chat import FALLBACK

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What generation needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, None when the model has none (chat is refused)."""
        ...

    @property
    def chat_adds_special_tokens(self) -> bool:
        """Whether a rendered chat prompt is encoded with BOS added. Hugging Face
        templates write BOS themselves (vLLM encodes chat with add_special_tokens false)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, special tokens left out (unless ``skip_special_tokens``
        is false), broken UTF-8 as U+FFFD."""
        ...


class ByteTokenizer:
    """Bytes as tokens: ids 0-255 are the bytes of UTF-8 text, 256 is BOS, 257 is EOS."""

    BOS_ID = 256
    EOS_ID = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS_ID

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS_ID,)

    @property
    def bos_token(self) -> str:
        return ""

    @property
    def eos_token(self) -> str:
        return ""

    @property
    def chat_template(self) -> str | None:
        return FALLBACK  # carpool's own: the built-in random-weight model has no folder

    @property
    def chat_adds_special_tokens(self) -> bool:
        return True  # BOS is an id, not text: no template can write it

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        # BOS and EOS have no text (bos_token and eos_token are empty): nothing to show.
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


# The named special tokens of transformers' tokenizers (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where save_pretrained writes it (transformers >= 4.47)


@dataclass(frozen=True, slots=True)
class _SpecialTokens:
    bos_token: str
    eos_token: str
    chat_template: str | None
    eos_names: tuple[str, ...]
    # The tokens the config files make special (see _special_names): skipped when
    # decoding, as transformers does, even where tokenizer.json says otherwise.
    skipped: tuple[str, ...] = ()


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` with ``tokenizer_config.json``'s extras."""

    def __init__(
        self, tokenizer: Any, special: _SpecialTokens, extra_eos_ids: Sequence[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._bos_id = tokenizer.token_to_id(special.bos_token) if special.bos_token else None
        eos = [tokenizer.token_to_id(name) for name in special.eos_names]
        eos += list(extra_eos_ids)
        self._eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        skipped = (tokenizer.token_to_id(name) for name in special.skipped)
        self._skipped_ids = frozenset(i for i in skipped if i is not None)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """Load ``folder/tokenizer.json`` (required) and, when present,
        ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``chat_template``, the
        special ``added_tokens_decoder`` entries), ``special_tokens_map.json`` (older
        folders' special tokens, read as transformers reads it: when
        ``tokenizer_config.json`` has no ``added_tokens_decoder``), ``chat_template.jinja``
        (the template, ahead of ``tokenizer_config.json``'s) and ``generation_config.json``
        / ``config.json`` (more ``eos_token_id`` values, a number or a list).

        Raises:
            ConfigError: when ``tokenizer.json`` is missing or unreadable.
        """
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(folder)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError("source", str(path), f"a folder with tokenizer.json ({file} missing)")
        try:
            tokenizer = RustTokenizer.from_file(str(file))
        except Exception as error:
            raise ConfigError("source", str(file), f"a readable tokenizer.json ({error})") from None
        config = _read_json(path / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # transformers' legacy path
            config.update(_read_json(path / "special_tokens_map.json"))
        template = _chat_template(config.get("chat_template"))
        template_file = path / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, ValueError) as error:
                raise ConfigError(
                    "source", str(template_file), f"a readable chat template ({error})"
                ) from None
        eos_token = _token_text(config.get("eos_token"))
        special = _SpecialTokens(
            bos_token=_token_text(config.get("bos_token")),
            eos_token=eos_token,
            chat_template=template,
            eos_names=(eos_token,) if eos_token else (),
            skipped=_special_names(config),
        )
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            extra += [value] if isinstance(value, int) else list(value or [])
        return cls(tokenizer, special, extra)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_token(self) -> str:
        return self._special.bos_token

    @property
    def eos_token(self) -> str:
        return self._special.eos_token

    @property
    def chat_template(self) -> str | None:
        return self._special.chat_template

    @property
    def chat_adds_special_tokens(self) -> bool:
        return False  # the folder's template writes BOS (vLLM's default for chat)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = list(token_ids)
        if self._skipped_ids and skip_special_tokens:
            ids = [i for i in ids if i not in self._skipped_ids]
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError("source", str(path), f"a readable JSON file ({error})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    """``"</s>"`` or ``{"content": "</s>", ...}`` (an AddedToken) as its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _special_names(config: dict[str, Any]) -> tuple[str, ...]:
    """The texts of the tokens ``config`` makes special, as transformers reads it: the
    ``added_tokens_decoder`` entries marked ``special``; in a folder without that table
    (the older format), the named tokens (``bos_token``, ``eos_token``, ...). Extra ones
    (``additional_special_tokens``) keep ``tokenizer.json``'s flag, as in transformers."""
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        names = [
            _token_text(token)
            for token in decoder.values()
            if isinstance(token, dict) and token.get("special") is True
        ]
        return tuple(dict.fromkeys(n for n in names if n))
    names = [_token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS]
    return tuple(dict.fromkeys(n for n in names if n))


def _chat_template(value: Any) -> str | None:
    """A template string, or the ``default`` of a list of ``{name, template}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    ``prefix`` ids are context only (a prompt's tail): their text is never emitted, but
    the first generated token decodes next to them, as it would in the full text.
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_skip_special", "_tokenizer")

    CONTEXT_TOKENS = 6  # ids decoded left of the new ones, for merges and leading spaces

    def __init__(
        self, tokenizer: Tokenizer, prefix: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prefix[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ``token_ids``; return the text they complete (maybe ``""``)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (a broken UTF-8 tail, as U+FFFD) at the end."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._decode
        before = decode(self._ids[self._prefix_offset : self._read_offset])
        after = decode(self._ids[self._prefix_offset :])
        if not final and after.endswith(REPLACEMENT_CHAR):
            return ""  # a character is still incomplete: wait for its next byte(s)
        if len(after) <= len(before) and not final:
            return ""  # the decoder merged or hid the new ids (special tokens): nothing new
        delta = after[len(before) :]
        self._prefix_offset = max(self._prefix_offset, self._read_offset - self.CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        if self._prefix_offset > 4 * self.CONTEXT_TOKENS:  # keep the window list short
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._skip_special:  # the tokenizer's default: test fakes need not take the flag
            return self._tokenizer.decode(token_ids)
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def check_token_ids(token_ids: Sequence[Any], vocab_size: int, what: str = "prompt") -> list[int]:
    """``token_ids`` as a list of ints within the vocabulary.

    Raises:
        InvalidInput: naming the first id that is not an int in ``[0, vocab_size)``.
    """
    for i, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidInput(f"{what}[{i}]={token!r}: expected a token id in [0, {vocab_size})")
    return [int(t) for t in token_ids]
