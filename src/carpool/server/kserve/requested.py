"""The outputs a request asks for: read from either wire, resolved against the model, and
made into the tensors an answer carries.

Both wires name outputs the same way (a name and its parameters) and differ only in how
a parameter is written: a JSON value over REST, an ``InferParameter`` over gRPC. Each wire
hands :func:`requested_outputs` its entries with a reader for their parameters; the checks
(one name once, no shared memory, ``binary_data`` a bool, a ``classification`` count) and
their messages are the same for both::

    REST  {"name": "y", "parameters": {"classification": 3}}  ─┐
    gRPC  InferRequestedOutputTensor(name="y", parameters=...) ─┴─► RequestedOutput("y", ...)
                                                         wanted_outputs ─► [TensorSpec y]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from carpool.errors import InvalidInput
from carpool.server.classification import classified_outputs
from carpool.server.kserve.tensors import (
    UNSUPPORTED_OUTPUT_PARAMETERS,
    OutputTensor,
    RequestedOutput,
    unsupported_output_parameter,
)

if TYPE_CHECKING:
    from carpool.server.repository import ServedModel, TensorSpec

__all__ = ["answer_tensors", "requested_outputs", "wanted_outputs"]

_Entry = TypeVar("_Entry")


def requested_outputs(
    entries: Iterable[tuple[str, _Entry]],
    *,
    is_binary_default: bool,
    parameters_of: Callable[[str, _Entry], Mapping[str, Any]],
    class_count_of: Callable[[str, Any], int],
) -> tuple[RequestedOutput, ...]:
    """The outputs named by ``entries``, ``(name, the wire's entry)`` in request order.

    ``parameters_of(where, entry)`` reads an entry's parameters as Python values (a wire
    leaves out what it does not read); ``class_count_of(where, value)`` reads its
    ``classification`` parameter, as that wire's Triton endpoint reads it. An output
    without ``binary_data`` goes back as ``is_binary_default`` says.

    Raises:
        InvalidInput: naming the output and the parameter that is wrong.
    """
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for name, entry in entries:
        where = f"output {name!r}"
        if name in seen:
            raise InvalidInput(f"{where}: name appears more than once in 'outputs'")
        seen.add(name)
        parameters = parameters_of(where, entry)
        for unsupported in UNSUPPORTED_OUTPUT_PARAMETERS:
            value = parameters.get(unsupported)
            if value:
                raise unsupported_output_parameter(where, unsupported, value)
        is_binary = parameters.get("binary_data", is_binary_default)
        if not isinstance(is_binary, bool):
            raise InvalidInput(
                f"{where}: parameters.binary_data must be true or false, got {is_binary!r}"
            )
        count = parameters.get("classification")
        class_count = 0 if count is None else class_count_of(where, count)
        requested.append(RequestedOutput(name, is_binary, class_count))
    return tuple(requested)


def wanted_outputs(
    model: ServedModel, requested: tuple[RequestedOutput, ...] | None
) -> list[TensorSpec]:
    """The declared outputs ``requested`` names, in its order; all of them when it is None.

    Raises:
        InvalidInput: an output the model does not declare.
    """
    if requested is None:
        return list(model.outputs)
    by_name = {spec.name: spec for spec in model.outputs}
    wanted = []
    for output in requested:
        spec = by_name.get(output.name)
        if spec is None:
            raise InvalidInput(
                f"unknown output {output.name!r} for model {model.name!r}; "
                f"expected {sorted(by_name)}"
            )
        wanted.append(spec)
    return wanted


def answer_tensors(
    wanted: list[TensorSpec], result: dict[str, Any], classes: dict[str, int] | None
) -> list[OutputTensor]:
    """The ``wanted`` outputs of the model's ``result`` in their declared datatypes, those
    named in ``classes`` as their top classes (BYTES): what either wire encodes."""
    if classes is None:
        return [OutputTensor(spec.name, result[spec.name], spec.datatype) for spec in wanted]
    return classified_outputs(wanted, result, classes)
