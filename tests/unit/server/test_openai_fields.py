"""The fields of an OpenAI completion request: what no one defines is ignored (logged once
per name, counted) or, under --strict-openai, refused; what carpool cannot do is refused."""

from __future__ import annotations

import orjson
import pytest

from carpool.server.completions import prepare
from carpool.server.openai import BadParam
from carpool.server.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_FIELD_NAMES,
    OTHER_FIELDS,
    IgnoredFields,
)

from .test_completions import MODEL, tiny_generation_app


@pytest.fixture
async def app():
    async with tiny_generation_app() as app:
        yield app


async def test_unknown_fields_are_ignored_and_counted_unless_strict(app, caplog):
    body = orjson.dumps({"model": MODEL, "prompt": "x", "bogus": 1, "other": 2})
    fields = IgnoredFields()
    with caplog.at_level("WARNING", logger="carpool.server.openai"):
        for _ in range(3):
            await prepare(app.repository, body, is_chat=False, fields=fields)
    assert fields.counts() == {"bogus": 3, "other": 3}
    warned = [
        r.getMessage() for r in caplog.records if "ignored the request field" in r.getMessage()
    ]
    assert len(warned) == 2  # one per field name, not per request
    with pytest.raises(BadParam, match="--strict-openai") as caught:
        await prepare(app.repository, body, is_chat=False, fields=IgnoredFields(strict=True))
    assert caught.value.param == "bogus"


def test_ignored_field_names_past_the_bound_share_one_label():
    fields = IgnoredFields()
    for i in range(MAX_FIELD_NAMES + 5):
        fields.check({"model": MODEL, f"f{i}": 1}, COMPLETION_FIELDS)
    counts = fields.counts()
    assert len(counts) == MAX_FIELD_NAMES + 1 and counts[OTHER_FIELDS] == 5


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"guided_json": {}}, "guided_json"),
    ],
)
def test_what_carpool_cannot_do_is_refused_even_when_lenient(doc, param):
    with pytest.raises(BadParam, match="not supported by carpool") as caught:
        IgnoredFields().check({"model": MODEL, **doc}, COMPLETION_FIELDS)
    assert caught.value.param == param


def test_neutral_values_and_harmless_fields_pass_uncounted():
    fields = IgnoredFields(strict=True)
    doc = {"tools": [], "response_format": {"type": "text"}, "user": "u", "metadata": {}}
    fields.check({"model": MODEL, **doc}, COMPLETION_FIELDS)
    assert fields.counts() == {}


def test_vllms_include_reasoning_passes_strict_and_uncounted():
    """vLLM's chat request defines it; carpool parses no reasoning, so either value
    changes nothing it writes."""
    fields = IgnoredFields(strict=True)
    for value in (True, False):
        fields.check({"model": MODEL, "include_reasoning": value}, CHAT_FIELDS)
    assert fields.counts() == {}
