"""Compressed request bodies: ``Content-Encoding: gzip`` or ``deflate``.

``tritonclient.http`` compresses a request with ``request_compression_algorithm`` and
Triton inflates it before parsing; so does carpool, with the body limit applied to the
inflated size (a small compressed body must not become a huge one).
"""

from __future__ import annotations

import zlib

from carpool.errors import InvalidInput
from carpool.server.errors import PayloadTooLarge

# zlib window bits: gzip's wrapper; deflate as HTTP means it (zlib's wrapper, RFC 9110),
# then raw deflate, which some clients send under the same name.
_WBITS = {b"gzip": (31,), b"x-gzip": (31,), b"deflate": (15, -15)}


def inflate(body: bytes, encoding: bytes, limit_bytes: int) -> bytes:
    """``body`` inflated as ``encoding`` says (``identity``: as it is).

    Raises:
        InvalidInput: an encoding other than gzip, deflate or identity, or a body that
            does not inflate.
        PayloadTooLarge: the inflated body is over ``limit_bytes``.
    """
    name = encoding.strip().lower()
    if name == b"identity":
        return body
    attempts = _WBITS.get(name)
    if attempts is None:
        raise InvalidInput(
            f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; "
            "expected gzip, deflate or identity"
        )
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(body, limit_bytes + 1)
        except zlib.error as error:
            failure = error
            continue
        if len(data) > limit_bytes or inflater.unconsumed_tail:
            raise PayloadTooLarge(len(data) + len(inflater.unconsumed_tail), limit_bytes)
        if not inflater.eof:
            raise InvalidInput(f"request body is truncated {name.decode()} data")
        return data
    raise InvalidInput(f"request body is not valid {name.decode()} data: {failure}")
