"""Found in a review of the torch runner's forward check and of ``/config``'s queue
policies, each through ``carpool serve`` as a user runs it. Each test failed before its fix.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

# A forward decorated with functools.wraps by a decorator that supplies an argument
# itself: the call reaches the wrapper, which takes x alone.
DECORATED = """
import functools

import torch
from torch import nn


def with_bias(forward):
    @functools.wraps(forward)
    def wrapper(self, x):
        return forward(self, x, torch.ones_like(x))

    return wrapper


class Biased(nn.Module):
    @with_bias
    def forward(self, x, bias):
        return x + bias


def biased():
    return Biased()
"""


def test_torch_forward_decorated_to_supply_an_argument_is_served(
    start_server: Any, tmp_path: Path
) -> None:
    # The load check read the wrapped function's (x, bias) through __wrapped__ and refused
    # the one declared input: `carpool serve` exited 2 for a model that runs as declared.
    config = textwrap.dedent("""\
        models:
          - name: biased
            kind: torch
            source: afternoon_models:biased
            inputs: [{name: x, datatype: FP32, shape: [3]}]
            outputs: [{name: y, datatype: FP32, shape: [3]}]
        """)
    models = tmp_path / "models"
    models.mkdir()
    (models / "afternoon_models.py").write_text(DECORATED, encoding="utf-8")
    served = start_server(config, env={"PYTHONPATH": str(models)})
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        tensor = httpclient.InferInput("x", [2, 3], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("biased", [tensor])
        np.testing.assert_array_equal(result.as_numpy("y"), x + 1)
    finally:
        client.close()


def test_grpc_model_config_of_queue_bounds_past_tritons_field_widths(start_server: Any) -> None:
    # A model-wide max_queue_size past uint32 and a class timeout past uint64 microseconds
    # made gRPC ModelConfig fail (the JSON could not be put in the proto); a class timeout
    # under half a microsecond was shown as 0, Triton's "no timeout".
    config = textwrap.dedent("""\
        models:
          - name: double
            kind: python
            source: configmodels:double
            inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
            outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
            max_queue_size: 10000000000
            max_delay_s: 1.0e+20
            classes:
              - {name: forever, timeout_s: 1.0e+20}
              - {name: instant, timeout_s: 1.0e-7}
            default_class: forever
        """)
    served = start_server(config, grpc=True)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        batching = client.get_model_config("double", as_json=True)["config"]["dynamic_batching"]
    finally:
        client.close()
    levels = batching["priority_queue_policy"]
    # as_json writes uint64 as strings and uint32 as numbers, as protobuf's JSON does
    assert levels["1"]["default_timeout_microseconds"] == str(2**64 - 1)
    assert levels["1"]["max_queue_size"] == 2**32 - 1
    assert levels["2"]["default_timeout_microseconds"] == "1"
    assert batching["default_queue_policy"] == levels["1"]
    assert batching["max_queue_delay_microseconds"] == str(2**64 - 1)
    rest = httpclient.InferenceServerClient(served.http_url)
    try:
        rest_levels = rest.get_model_config("double")["dynamic_batching"]["priority_queue_policy"]
    finally:
        rest.close()
    assert rest_levels["1"]["max_queue_size"] == 2**32 - 1  # both wires say the same
    assert rest_levels["2"]["default_timeout_microseconds"] == 1
