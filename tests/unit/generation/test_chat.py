"""Chat templates: the fallback, a folder's Jinja template (checked against transformers'
``apply_chat_template`` on the same template), features of real Hub templates, and
messages as OpenAI sends them."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.errors import ConfigError, InvalidInput
from carpool.generation.chat import ChatMessage, render_chat

# Llama-2's template, shortened: trim_blocks/lstrip_blocks and raise_exception matter here.
LLAMA2 = """{% if messages[0]['role'] == 'system' %}
    {% set loop_messages = messages[1:] %}{% set system = messages[0]['content'] %}
{% else %}
    {% set loop_messages = messages %}{% set system = false %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% if loop.index0 == 0 and system %}
        {% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}
    {% else %}
        {% set content = message['content'] %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {% else %}
        {{ ' ' + content.strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""

MESSAGES = [
    ChatMessage("system", "Be terse."),
    ChatMessage("user", "Hi!"),
    ChatMessage("assistant", "Hello."),
    ChatMessage("user", "Bye?"),
]


def test_fallback_template_marks_roles_and_opens_the_assistant_turn():
    text = render_chat(MESSAGES[:2], None)
    assert text == "<|system|>\nBe terse.\n<|user|>\nHi!\n<|assistant|>\n"
    assert render_chat(MESSAGES[1:2], None, add_generation_prompt=False) == "<|user|>\nHi!\n"


def test_folder_template_renders_as_transformers_does(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, "[UNK]")),
        bos_token="<s>",
        eos_token="</s>",
    )
    reference.chat_template = LLAMA2
    expected = reference.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in MESSAGES], tokenize=False
    )
    got = render_chat(MESSAGES, LLAMA2, bos_token="<s>", eos_token="</s>")
    assert got == expected
    assert "<s>[INST] <<SYS>>\nBe terse.\n<</SYS>>\n\nHi! [/INST]" in got


def test_template_refusal_is_invalid_input_with_its_message():
    with pytest.raises(InvalidInput, match="roles must alternate"):
        render_chat([ChatMessage("user", "a"), ChatMessage("user", "b")], LLAMA2)


def test_broken_template_is_a_config_error():
    with pytest.raises(ConfigError, match="a valid Jinja template"):
        render_chat(MESSAGES, "{% for %}")


def test_template_runs_sandboxed():
    with pytest.raises(InvalidInput, match="template failed"):
        render_chat(MESSAGES, "{{ messages.__class__.__mro__[1].__subclasses__() }}")


def test_no_messages_is_invalid_input():
    with pytest.raises(InvalidInput, match="messages is empty"):
        render_chat([], None)


def test_messages_from_openai_json_join_text_parts():
    value = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert ChatMessage.from_json(value, 0) == ChatMessage("user", "a\nb")  # as vLLM joins
    assert ChatMessage.from_json({"role": "assistant", "content": None}, 1).content == ""


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("hi", r"messages\[3\] is a str"),
        ({"role": "robot", "content": "x"}, r"messages\[3\]\.role='robot'"),
        ({"role": "user", "content": 5}, r"messages\[3\]\.content is a int"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            r"messages\[3\]\.content\[0\] is of type 'image_url'",
        ),
    ],
)
def test_bad_messages_are_named(value, match):
    with pytest.raises(InvalidInput, match=match):
        ChatMessage.from_json(value, 3)


# --- template features of real Hub templates ------------------------------------------


def _as_dicts(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_json(m, i) for i, m in enumerate(messages)]


def _transformers_render(template: str, messages: list[dict[str, Any]], **special: str) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, "[UNK]")),
        bos_token="<s>",
        eos_token="</s>",
        **special,
    )
    reference.chat_template = template
    return str(reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_template_can_break_out_of_a_loop():
    """``{% break %}``/``{% continue %}`` (Jinja's loopcontrols, on in transformers)."""
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }};{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    expected = _transformers_render(template, messages)
    assert expected == "a;"
    assert render_chat(_as_dicts(messages), template) == expected


def test_tojson_writes_unicode_and_markup_as_transformers_does():
    """transformers' ``tojson`` keeps non-ASCII text and ``<``/``&`` as they are (Jinja's
    own escapes them for HTML) and takes ``indent``, ``separators`` and ``sort_keys``."""
    template = (
        "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|"
        "{{ m.content | tojson(separators=(',', ':')) }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "café <b> & 'q' 🚗"}]
    expected = _transformers_render(template, messages)
    assert "café <b> & 'q' 🚗" in expected
    assert render_chat(_as_dicts(messages), template) == expected


def test_message_name_reaches_the_template():
    template = (
        "{% for m in messages %}{% if m.name is defined %}{{ m.name }}@{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi", "name": "ana"},
    ]
    expected = _transformers_render(template, messages)
    assert "ana@user: Hi" in expected
    assert render_chat(_as_dicts(messages), template) == expected


def test_a_name_that_is_not_a_string_is_refused():
    with pytest.raises(InvalidInput, match=r"messages\[0\]\.name"):
        ChatMessage.from_json({"role": "user", "content": "x", "name": 5}, 0)
