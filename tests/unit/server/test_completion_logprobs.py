"""Log-probabilities in OpenAI's completions and chat shapes."""

from __future__ import annotations

from carpool.generation.tokenizer import ByteTokenizer
from carpool.generation.types import TokenLogprobs
from carpool.server.completion_logprobs import LogprobsWriter

A, B, PIECE_1, PIECE_2 = ord("a"), ord("b"), 0xC3, 0xA9  # "é" is two bytes: two pieces

FOUND = [
    TokenLogprobs(A, -0.5, ((A, -0.5), (B, -1.5))),
    TokenLogprobs(B, -2.0, ((PIECE_1, -0.1), (PIECE_2, -0.2), (A, -1.0))),
]


def test_completions_shape_counts_text_offsets_from_the_echo() -> None:
    writer = LogprobsWriter(ByteTokenizer(), is_chat=False, start_offset=3)
    first = writer.document(FOUND[:1])
    second = writer.document(FOUND[1:])  # the next streamed chunk goes on counting
    assert first == {
        "tokens": ["a"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"a": -0.5, "b": -1.5}],
        "text_offset": [3],
    }
    assert second["text_offset"] == [4]
    # The two pieces decode alike (U+FFFD): the more likely one's value is kept, and the
    # sampled token is in the dict though outside the top 3.
    assert second["top_logprobs"] == [{"\ufffd": -0.1, "a": -1.0, "b": -2.0}]


def test_chat_shape_has_bytes_and_ordered_alternatives() -> None:
    document = LogprobsWriter(ByteTokenizer(), is_chat=True).document(FOUND[:1])
    assert document == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [A],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [A]},
                    {"token": "b", "logprob": -1.5, "bytes": [B]},
                ],
            }
        ]
    }


def test_tokens_as_ids_tell_pieces_apart() -> None:
    writer = LogprobsWriter(ByteTokenizer(), is_chat=False, tokens_as_ids=True)
    top = writer.document(FOUND[1:])["top_logprobs"][0]
    assert set(top) == {f"token_id:{t}" for t in (PIECE_1, PIECE_2, A, B)}


class SpecialTokens(ByteTokenizer):
    """Bytes, and BOS and EOS with text of their own ("<s>", "</s>"), as a Hugging Face
    tokenizer's special tokens have: decoded only when not skipped."""

    def decode(self, token_ids, *, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        names = {self.BOS_ID: "<s>", self.EOS_ID: "</s>"}
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in names]
        return "".join(names.get(t, chr(t)) for t in token_ids)


def test_special_tokens_are_named_by_their_text_as_vllm_names_them() -> None:
    """They were all "": not told apart, one key of top_logprobs, and an echoed prompt's
    offsets short of its text."""
    bos, eos = ByteTokenizer.BOS_ID, ByteTokenizer.EOS_ID
    found = [TokenLogprobs(A, -0.5, ((bos, -1.0), (eos, -2.0))), TokenLogprobs(eos, -3.0, ())]
    writer = LogprobsWriter(SpecialTokens(), is_chat=False)
    echoed = writer.prompt_document(bos, found)
    assert echoed["tokens"] == ["<s>", "a", "</s>"]
    assert echoed["text_offset"] == [0, 3, 4]  # "<s>a</s>"
    assert echoed["top_logprobs"][1] == {"a": -0.5, "<s>": -1.0, "</s>": -2.0}
    chat = LogprobsWriter(SpecialTokens(), is_chat=True).document(found[1:])
    assert chat["content"][0]["token"] == "</s>"
    assert chat["content"][0]["bytes"] == list(b"</s>")
