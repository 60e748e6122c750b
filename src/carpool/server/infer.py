"""The KServe infer route as the HTTP layer calls it.

:func:`prepare_infer` and :func:`infer_response` are the REST face of the KServe codec
(:mod:`carpool.server.kserve.rest`, with its per-header :class:`InferPlans`); here are the
answers that are HTTP's own: a failure as its status and error document
(:func:`error_response`), and an answer compressed as the client accepts
(:func:`compressed`).
"""

from __future__ import annotations

import orjson

from carpool.server.encoding import MIN_COMPRESSED_BYTES, compress
from carpool.server.errors import http_error, openai_error
from carpool.server.kserve.rest import (
    JSON_HEADERS,
    Answer,
    Headers,
    InferCall,
    InferPlan,
    InferPlans,
    infer_response,
    prepare_infer,
)

__all__ = [
    "Answer",
    "Headers",
    "InferCall",
    "InferPlan",
    "InferPlans",
    "compressed",
    "error_response",
    "infer_response",
    "prepare_infer",
]

_VARY = (b"vary", b"accept-encoding")


def compressed(answer: Answer, encoding: bytes | None) -> Answer:
    """A successful ``answer`` compressed in ``encoding`` (what the client's
    ``Accept-Encoding`` chose, None: as it is), when it is large enough to gain. A binary
    answer's Inference-Header-Content-Length keeps counting its uncompressed JSON, as
    Triton's does: the client inflates the body before it splits it. ``Vary`` tells a
    cache between client and server that the body was chosen by ``Accept-Encoding``."""
    status, body, headers = answer
    if encoding is None or status != 200 or len(body) < MIN_COMPRESSED_BYTES:
        return answer
    coded = ((b"content-encoding", encoding), _VARY)
    return status, compress(body, encoding), (*headers, *coded)


def error_response(exc: Exception, *, is_openai: bool = False) -> Answer:
    """(status, body, headers) for a failed request: ``{"error": message}``, or OpenAI's
    error document on ``/v1/`` paths."""
    if is_openai:
        error, document = openai_error(exc)
        return error.status, orjson.dumps(document), (*JSON_HEADERS, *error.headers)
    error = http_error(exc)
    return error.status, orjson.dumps({"error": error.message}), (*JSON_HEADERS, *error.headers)
