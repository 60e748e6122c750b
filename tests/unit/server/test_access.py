"""The API key and what it leaves open (carpool.server.access), without a server."""

from __future__ import annotations

import pickle

import pytest

from carpool.errors import ConfigError
from carpool.server.access import API_KEY_ENV, Access, api_key_from, refusal

KEY = "k3y-0f-th1s-s3rv3r"


def test_without_a_key_everything_is_allowed() -> None:
    access = Access()
    assert access.allows(None)
    assert access.allows(b"Bearer anything")
    access.check_http("/v2/models/m/infer", None)


@pytest.mark.parametrize(
    "authorization",
    [b"Bearer " + KEY.encode(), b"bearer " + KEY.encode(), b"BEARER  " + KEY.encode() + b" "],
)
def test_the_key_as_a_bearer_token_is_allowed(authorization: bytes) -> None:
    assert Access(KEY).allows(authorization)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        b"",
        KEY.encode(),  # no scheme
        b"Basic " + KEY.encode(),
        b"Bearer",
        b"Bearer " + KEY.encode()[:-1],
        b"Bearer " + KEY.encode() + b"x",
        b"Bearer " + KEY.upper().encode(),
    ],
)
def test_anything_but_the_key_is_refused(authorization: bytes | None) -> None:
    access = Access(KEY)
    assert not access.allows(authorization)
    with pytest.raises(Exception) as raised:
        access.check_http("/v2/models/m/infer", authorization)
    message = str(raised.value)
    assert KEY not in message  # the message never repeats a key, good or bad
    for part in (authorization or b"").split():
        if part.lower() not in (b"bearer", b"basic"):
            assert part.decode() not in message


def test_the_refusal_says_what_was_wrong_without_what_was_sent() -> None:
    assert str(refusal(None)).startswith("no API key was sent")
    assert str(refusal(b"Basic c2VjcmV0")).startswith("the Authorization header is not")
    wrong = refusal(b"Bearer guessed-key")
    assert str(wrong).startswith("the API key sent is not this server's")
    assert "guessed-key" not in str(wrong)
    assert "Authorization: Bearer <key>" in str(wrong)


@pytest.mark.parametrize(
    ("path", "protect_metrics", "is_open"),
    [
        ("/v2/health/live", False, True),
        ("/v2/health/ready", True, True),
        ("//v2//health/ready", False, True),  # split as the router splits it
        ("/health", False, True),  # vLLM's probes, open as vLLM leaves them
        ("/ping/", True, True),
        ("/version", False, False),
        ("/health/x", False, False),
        ("/metrics", False, True),
        ("/metrics", True, False),
        ("/metrics/", False, True),
        ("/v2", False, False),
        ("/v2/models/m/infer", False, False),
        ("/v2/models/health/ready", False, False),
        ("/v1/models", False, False),
        ("/v2/healthy/live", False, False),
    ],
)
def test_only_health_and_unprotected_metrics_are_open(
    path: str, protect_metrics: bool, is_open: bool
) -> None:
    access = Access(KEY, protect_metrics=protect_metrics)
    assert access.is_open(path) is is_open
    if is_open:
        access.check_http(path, None)
    else:
        with pytest.raises(Exception, match="no API key was sent"):
            access.check_http(path, None)


def test_the_flag_wins_over_the_environment() -> None:
    assert api_key_from("from-flag", {API_KEY_ENV: "from-env"}) == "from-flag"
    assert api_key_from(None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert api_key_from(None, {}) is None


@pytest.mark.parametrize(
    ("flag", "environ", "source"),
    [("", {}, "--api-key"), (None, {API_KEY_ENV: ""}, API_KEY_ENV)],
)
def test_an_empty_key_is_refused_naming_where_it_came_from(
    flag: str | None, environ: dict[str, str], source: str
) -> None:
    with pytest.raises(ConfigError, match=f"invalid {source}='': expected a non-empty key"):
        api_key_from(flag, environ)
    with pytest.raises(ConfigError, match="non-empty"):
        Access("")


@pytest.mark.parametrize("key", ["has space", "tab\there", "naïve", "line\nbreak"])
def test_a_key_a_header_cannot_carry_is_refused_without_showing_it(key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        api_key_from(key, {})
    assert key not in str(raised.value)
    assert f"a key of {len(key)} characters, not shown" in str(raised.value)
    assert "printable ASCII" in str(raised.value)
    copied = pickle.loads(pickle.dumps(raised.value))  # errors cross processes
    assert str(copied) == str(raised.value)


def test_the_key_is_not_in_the_repr() -> None:
    assert KEY not in repr(Access(KEY, protect_metrics=True))
