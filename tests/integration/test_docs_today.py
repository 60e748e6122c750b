"""Found running the docs changed today as a user would, against ``carpool serve``.
Each test failed before its fix.
"""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def test_expired_microsecond_timeout_is_named_in_microseconds(start_server: Any) -> None:
    # KServe's `timeout` parameter is in microseconds; a request given 1 µs was answered
    # "past its timeout of 0.0 ms", which reads as no timeout at all.
    config = textwrap.dedent("""\
        models:
          - name: double
            kind: python
            source: configmodels:double
            inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
            outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
            max_batch_size: 64
            max_delay_s: 0.05
        """)
    served = start_server(config)
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("double", [tensor], timeout=1)
    finally:
        client.close()
    assert caught.value.status() == "503", caught.value
    assert "past its timeout of 1 µs" in caught.value.message(), caught.value
