"""Compressed bodies: ``Content-Encoding: gzip`` or ``deflate``, both ways.

``tritonclient.http`` compresses a request with ``request_compression_algorithm`` and
Triton inflates it before parsing; so does carpool, with the body limit applied to the
inflated size (a small compressed body must not become a huge one).

With ``response_compression_algorithm`` the client sends ``Accept-Encoding`` and Triton
compresses the infer answer; so does carpool (:func:`response_encoding`, :func:`compress`),
for answers of at least ``MIN_COMPRESSED_BYTES``: smaller ones gain nothing and go back as
they are, which every HTTP client reads. zlib's level 1, as nginx's default: a float
tensor shrinks little more at higher levels and the event loop pays for every level.
"""

from __future__ import annotations

import functools
import zlib

from carpool.errors import InvalidInput
from carpool.server.errors import PayloadTooLarge

# zlib window bits: gzip's wrapper; deflate as HTTP means it (zlib's wrapper, RFC 9110),
# then raw deflate, which some clients send under the same name.
_WBITS = {b"gzip": (31,), b"x-gzip": (31,), b"deflate": (15, -15)}
MIN_COMPRESSED_BYTES = 1024
COMPRESS_LEVEL = 1
# The codings an answer may go back in, by the names a client may give them.
_OFFERED = {b"gzip": b"gzip", b"x-gzip": b"gzip", b"deflate": b"deflate", b"identity": b"identity"}


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


# Clients repeat one Accept-Encoding value (httpx, aiohttp, requests send theirs on every
# request): parsed once, not on every infer (docs/benchmarks.md has what that saves).
@functools.lru_cache(maxsize=64)
def response_encoding(accept_encoding: bytes) -> bytes | None:
    """The coding to answer in under an ``Accept-Encoding`` value (RFC 9110 12.5.3), as
    Triton chooses it: of ``gzip``, ``deflate`` and ``identity``, the one with the highest
    weight above 0, the first named on a tie; when none is acceptable by name, ``*``
    stands for gzip, or deflate if gzip is named. None means identity (also when nothing
    acceptable is named). A malformed weight counts as 0: never compressed by a guess."""
    best, best_weight, star = None, 0.0, 0.0
    named: set[bytes] = set()
    for item in accept_encoding.lower().split(b","):
        name, _, params = item.partition(b";")
        name = name.strip()
        weight = 1.0
        for param in params.split(b";"):
            key, _, value = param.partition(b"=")
            if key.strip() == b"q":
                try:
                    weight = min(max(float(value.strip()), 0.0), 1.0)
                except ValueError:
                    weight = 0.0
        if name == b"*":
            star = weight
        elif name in _OFFERED:
            named.add(_OFFERED[name])
            if weight > best_weight:
                best, best_weight = _OFFERED[name], weight
    if best is None and star > 0.0:  # * stands for the codings not named
        return next((c for c in (b"gzip", b"deflate") if c not in named), None)
    return None if best == b"identity" else best


def compress(body: bytes, encoding: bytes) -> bytes:
    """``body`` compressed as ``encoding`` (from :func:`response_encoding`): gzip's
    wrapper, or zlib's for ``deflate`` as HTTP means it."""
    return zlib.compress(body, COMPRESS_LEVEL, 31 if encoding == b"gzip" else 15)
