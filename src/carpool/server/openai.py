"""OpenAI-compatible endpoints: ``POST /v1/embeddings`` and ``GET /v1/models[/{model}]``.

Pure request → response-bytes functions; :mod:`carpool.server.app` routes to them, reads
bodies and watches for disconnects, and :func:`carpool.server.errors.openai_error` gives
failures OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "input", "code": null}}

``POST /v1/embeddings`` takes ``model``, ``input`` (a string, a list of strings, a list of
token ids or a list of such lists), ``encoding_format`` ("float" or "base64"),
``dimensions`` (only the model's own size), ``user`` (ignored) and carpool's ``priority``
(a class name) and ``timeout_s``.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from carpool.core.admission import is_timeout
from carpool.errors import InvalidInput
from carpool.server.embeddings import EmbeddingService
from carpool.server.errors import NotFound
from carpool.server.repository import ModelRepository

_KNOWN_FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "priority", "timeout_s")
_STARTED = int(time.time())


class BadParam(InvalidInput):
    """Invalid input that OpenAI's error object names by ``param`` (and, where OpenAI
    has one, by ``code``: ``context_length_exceeded``)."""

    def __init__(self, param: str, message: str, *, code: str | None = None) -> None:
        self.param = param
        self.code = code
        super().__init__(message)

    def _init_args(self) -> tuple[tuple[object, ...], dict[str, object]]:
        return (self.param, self.reason), {"code": self.code}


def list_models(repository: ModelRepository) -> bytes:
    """``GET /v1/models``: every model with an OpenAI face (generation models name their
    owner, which tells random weights apart)."""
    data = [_model_object(name, owner) for name, owner in _owners(repository).items()]
    return orjson.dumps({"object": "list", "data": data})


def retrieve_model(repository: ModelRepository, name: str) -> bytes:
    """``GET /v1/models/{model}``: that model's object, as the listing has it (what
    ``client.models.retrieve`` asks).

    Raises:
        NotFound: no model of that name has an OpenAI face (404, naming those that do).
    """
    owners = _owners(repository)
    owner = owners.get(name)
    if owner is None:
        raise NotFound(f"model {name!r}", sorted(owners), is_model=True)
    return orjson.dumps(_model_object(name, owner))


def _owners(repository: ModelRepository) -> dict[str, str]:
    owners = {name: "carpool" for name in repository.embedding_services()}
    owners |= {name: g.owned_by for name, g in repository.generation_services().items()}
    return owners


def _model_object(name: str, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": owner}


async def create_embeddings(repository: ModelRepository, body: bytes) -> bytes:
    """``POST /v1/embeddings``: the response body, or raises (InvalidInput, NotFound, ...)."""
    doc = json_object(body, _KNOWN_FIELDS)
    service = _model(repository, doc)
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadParam("encoding_format", f"encoding_format={encoding!r}: expected float or base64")
    dimensions = doc.get("dimensions")
    if dimensions is not None and dimensions != service.dimensions:
        raise BadParam(
            "dimensions",
            f"dimensions={dimensions!r} is not supported: model {service.name!r} returns "
            f"{service.dimensions} dimensions and cannot shorten them; leave dimensions out",
        )
    texts, tokens = _inputs(doc.get("input"))
    try:
        options = _options(doc, service)
    except BadParam as error:
        if error.param == "priority":  # counted as the batcher counts it, once a text
            count = len(texts) if texts is not None else len(tokens or ())
            service.batcher.refuse_unknown_priority(doc.get("priority"), count)
        raise
    try:
        if texts is not None:
            embedded = await service.embed_texts(texts, **options)
        else:
            assert tokens is not None
            embedded = await service.embed_tokens(tokens, **options)
    except InvalidInput as error:  # what the service checks is the input's: name it
        raise BadParam("input", str(error)) from None
    rows: list[Any]
    if encoding == "base64":
        little = embedded.vectors.astype("<f4", copy=False)
        rows = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        rows = list(embedded.vectors)
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)
            ],
            "model": service.name,
            "usage": {"prompt_tokens": embedded.num_tokens, "total_tokens": embedded.num_tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def json_object(body: bytes, known_fields: tuple[str, ...]) -> dict[str, Any]:
    """The request body as a JSON object of ``known_fields``; raises naming what is wrong."""
    doc = parse_object(body)
    unknown = sorted(set(doc) - set(known_fields))
    if unknown:
        raise BadParam(unknown[0], f"unknown field {unknown[0]!r}; expected {list(known_fields)}")
    return doc


def parse_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, whatever its fields; raises saying what is wrong."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidInput(
            f"the request body is not valid JSON in UTF-8 ({error}); expected a JSON object"
        ) from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"the request body is a JSON {type(doc).__name__}; expected an object")
    return doc


def _model(repository: ModelRepository, doc: dict[str, Any]) -> EmbeddingService:
    name = doc.get("model")
    if not isinstance(name, str):
        raise BadParam("model", f"model={name!r}: expected the name of an embeddings model")
    services = repository.embedding_services()
    service = services.get(name)
    if service is None:
        raise NotFound(f"embeddings model {name!r}", sorted(services), is_model=True)
    return service


def priority_class(doc: dict[str, Any], classes: Sequence[str]) -> str | None:
    """The request's ``priority``: a class name, or None for the default class (absent,
    null, or vLLM's default priority 0, which vLLM's clients send).

    Raises:
        BadParam: any other value, naming the classes.
    """
    priority = doc.get("priority")
    if priority is None or (priority == 0 and type(priority) is int):
        return None
    if not isinstance(priority, str) or priority not in classes:
        raise BadParam(
            "priority",
            f"priority={priority!r}: expected a class name, one of {list(classes)} "
            "(or 0, vLLM's default)",
        )
    return priority


def _options(doc: dict[str, Any], service: EmbeddingService) -> dict[str, Any]:
    """The batcher keywords, checked here so that their errors name their field."""
    options: dict[str, Any] = {}
    priority = priority_class(doc, [c.name for c in service.batcher.policy.classes])
    if priority is not None:
        options["priority"] = priority
    timeout_s = doc.get("timeout_s")
    if timeout_s is not None:
        if not is_timeout(timeout_s):
            raise BadParam("timeout_s", f"timeout_s={timeout_s!r}: expected seconds > 0")
        options["timeout_s"] = timeout_s
    return options


def _inputs(value: Any) -> tuple[list[str] | None, list[Any] | None]:
    """``(texts, None)`` or ``(None, token arrays)``; raises naming what was wrong."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise BadParam(
            "input",
            f"input is a {type(value).__name__}; expected a string, a list of strings, a "
            "list of token ids or a list of such lists",
        )
    if not value:
        raise BadParam("input", "input is an empty list; expected at least one text")
    if isinstance(value[0], str):
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise BadParam(
                    "input",
                    f"input[{i}] is a {type(text).__name__}; expected a string like input[0]",
                )
            if not text:
                raise BadParam("input", f"input[{i}] is an empty string; expected some text")
        return value, None
    if all(_is_token(v) for v in value):
        return None, [_token_array(value, "input")]
    if _is_token(value[0]):  # a flat list of ids with something else in it
        i, item = next((i, v) for i, v in enumerate(value) if not _is_token(v))
        raise BadParam(
            "input",
            f"input[{i}] is {_not_token(item)}; expected a token id (an integer) like "
            "input[0], or every item a list of token ids",
        )
    for i, item in enumerate(value):
        if isinstance(item, list):  # a list of ids with something else in it: name that
            for j, token in enumerate(item):
                if not _is_token(token):
                    raise BadParam(
                        "input",
                        f"input[{i}][{j}] is {_not_token(token)}; expected a token id (an integer)",
                    )
        if not (isinstance(item, list) and item):
            what = "an empty list" if item == [] else f"a {type(item).__name__}"
            raise BadParam(
                "input",
                f"input[{i}] is {what}; expected every item to be a string, or every item "
                "a non-empty list of token ids",
            )
    return None, [_token_array(item, f"input[{i}]") for i, item in enumerate(value)]


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _not_token(value: Any) -> str:
    """What a value that is no token id is, for an error: the JSON reader makes an integer
    of 2^64 or more a float, which the client did not send, so such a number is named as
    too large rather than as a float."""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        return f"the number {value:.0f}, too large for a token id"
    return f"a {type(value).__name__}"


def _token_array(ids: list[int], where: str) -> np.ndarray:
    """int64 ids; an id past int64 is named here (NumPy would make the list float64)."""
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:
        j, big = next((j, t) for j, t in enumerate(ids) if not -(2**63) <= t < 2**63)
        raise BadParam(
            "input", f"{where}: token id {big} at position {j} is outside the vocabulary"
        ) from None
