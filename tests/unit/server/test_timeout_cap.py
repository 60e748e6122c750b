"""KServe's ``timeout`` parameter capped by the deadline of the request's class, as the
HTTP infer path's cached plans resolve it: again after each policy update, for the default
class and for a class named by priority."""

from __future__ import annotations

import orjson
import pytest

from carpool import Batcher, BatchPolicy, ClassPolicy
from carpool.server.infer import InferPlans, prepare_infer
from carpool.server.repository import ServedModel, TensorSpec


def _timeout_model() -> ServedModel:
    batcher = Batcher(
        lambda inputs: {"y": inputs["x"]},
        BatchPolicy(
            max_batch_size=8,
            classes=(ClassPolicy("interactive", timeout_s=0.1), ClassPolicy("normal")),
            default_class="normal",
        ),
        collate="dict",
    )
    return ServedModel(
        name="m",
        version="1",
        platform="python",
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (4,)),),
        batcher=batcher,
    )


def _json_body(**parameters: object) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    return orjson.dumps({"inputs": [tensor], "parameters": parameters})


def test_a_cached_plans_timeout_follows_the_class_deadline_of_each_policy() -> None:
    """The HTTP plans cache a request's options per policy object: a policy update must
    resolve the cap again, for the default class and for a class named by priority."""
    model, plans = _timeout_model(), InferPlans()
    longer = _json_body(timeout=5_000_000)
    named = _json_body(priority="interactive", timeout=5_000_000)
    by_level = _json_body(priority=1, timeout=50_000)
    assert prepare_infer(model, longer, None, plans).options == {"timeout_s": 5.0}
    assert prepare_infer(model, named, None, plans).options == {"priority": "interactive"}
    assert prepare_infer(model, by_level, None, plans).options == pytest.approx(
        {"priority": "interactive", "timeout_s": 0.05}
    )
    model.batcher.update_policy(
        classes=(ClassPolicy("interactive", timeout_s=10.0), ClassPolicy("normal", timeout_s=1.0))
    )
    assert prepare_infer(model, longer, None, plans).options == {}  # capped at 1 s
    assert prepare_infer(model, named, None, plans).options == {
        "priority": "interactive",
        "timeout_s": 5.0,
    }
    model.batcher.update_policy(timeout_s=2.0, classes=(ClassPolicy("normal"),))
    assert prepare_infer(model, longer, None, plans).options == {}  # the model-wide 2 s
