"""The installed uvicorn has every private hook and attribute carpool's fast path uses;
a uvicorn without them fails here, naming its version, and at server start-up."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from uvicorn.protocols.http import httptools_impl

from carpool.errors import ConfigError
from carpool.server import fasthttp, uvicorn_contract
from carpool.server.cycles import FastCycle


def test_installed_uvicorn_has_every_hook_the_fast_path_uses() -> None:
    gaps = uvicorn_contract.missing()
    assert gaps == [], (
        f"uvicorn {uvicorn_contract.uvicorn_version()} lacks what carpool.server.fasthttp "
        f"extends (checked on {uvicorn_contract.CHECKED_UVICORN}): {gaps}"
    )


def test_fast_cycle_provides_what_uvicorn_reads_from_a_cycle() -> None:
    cycle_fields = set(inspect.signature(FastCycle).parameters) | set(dir(FastCycle))
    cycle_fields |= set(getattr(FastCycle, "__slots__", ()))
    assert cycle_fields | _instance_attributes() >= uvicorn_contract.CYCLE_READS


def _instance_attributes() -> set[str]:
    source = inspect.getsource(FastCycle)
    return set(uvicorn_contract.re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=", source))


def test_fasthttp_overrides_only_methods_uvicorn_has() -> None:
    ours = {
        name
        for name, value in vars(fasthttp.InferProtocol).items()
        if callable(value) and not name.startswith("__")
    }
    theirs = {name for name in ours if hasattr(httptools_impl.HttpToolsProtocol, name)}
    # Every override of a uvicorn method is in the contract, so a rename there is caught.
    assert theirs <= set(uvicorn_contract.PROTOCOL_METHODS)


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        ("_start_asgi_task", "method HttpToolsProtocol._start_asgi_task"),
        ("timeout_keep_alive_handler", "method HttpToolsProtocol.timeout_keep_alive_handler"),
    ],
)
def test_a_uvicorn_without_a_hook_fails_start_up_naming_its_version(
    monkeypatch: pytest.MonkeyPatch, remove: str, named: str
) -> None:
    monkeypatch.delattr(httptools_impl.HttpToolsProtocol, remove)
    monkeypatch.setattr(uvicorn_contract, "uvicorn_version", lambda: "9.9.9")
    with pytest.raises(ConfigError) as info:
        fasthttp.protocol_for(object())  # type: ignore[arg-type]
    message = str(info.value)
    assert "uvicorn='9.9.9'" in message
    assert named in message
    assert uvicorn_contract.CHECKED_UVICORN in message


def test_a_uvicorn_reading_a_new_cycle_attribute_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = inspect.getsource
    extra = textwrap.indent("\ndef later(self):\n    return self.cycle.trailers\n", "    ")

    def source(obj: object) -> str:
        text = real(obj)  # type: ignore[arg-type]
        return text + extra if obj is httptools_impl.HttpToolsProtocol else text

    monkeypatch.setattr(uvicorn_contract.inspect, "getsource", source)
    assert uvicorn_contract.missing() == [
        "cycle.trailers, read by HttpToolsProtocol and not provided by FastCycle"
    ]


def test_a_uvicorn_that_no_longer_sets_an_attribute_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = inspect.getsource

    def source(obj: object) -> str:
        text = real(obj)  # type: ignore[arg-type]
        if obj is httptools_impl.HttpToolsProtocol:
            return text.replace("self.pipeline", "self._pipeline")
        return text

    monkeypatch.setattr(uvicorn_contract.inspect, "getsource", source)
    assert "attribute HttpToolsProtocol.pipeline (set by its methods)" in uvicorn_contract.missing()
