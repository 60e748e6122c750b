"""The machine a measurement ran on: CPU flags and the kernels chosen there."""

from __future__ import annotations

import sys

import pytest
import torch

from carpool.models import onednn
from carpool.tools import machine


def test_cpu_flags_are_the_kernel_relevant_ones_this_cpu_reports() -> None:
    flags = machine.cpu_flags()
    assert set(flags) <= set(machine._KERNEL_FLAGS)
    with open("/proc/cpuinfo") as f:
        reported = next(line for line in f if line.startswith(("flags", "Features"))).split()
    assert all(flag in reported for flag in flags)


def test_cpu_model_names_something() -> None:
    assert machine.cpu_model()


def test_torch_kernels_name_capability_and_linear_path_per_dtype() -> None:
    kernels = machine.torch_kernels()
    assert kernels["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert kernels["linear"]["float32"] == onednn.kernel_name(onednn.can_prepack(torch.float32))
    assert set(kernels["linear"]) == {"float32", "bfloat16"}


def test_torch_kernels_import_nothing_when_torch_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "torch")
    assert machine.torch_kernels() == {}


def test_model_kernels_say_how_the_models_linear_layers_run() -> None:
    assert machine.model_kernels([]) == {}
    assert machine.model_kernels([torch.nn.Linear(3, 2)]) == {"model_linear": "aten-linear"}
