"""REST request decoding under its former name: it lives in
:mod:`carpool.server.kserve.rest_decode`. Kept for the tests outside the codec that import
it from here; new code imports from ``carpool.server.kserve``.
"""

from __future__ import annotations

from carpool.server.kserve.rest_decode import decode_infer_request

__all__ = ["decode_infer_request"]
