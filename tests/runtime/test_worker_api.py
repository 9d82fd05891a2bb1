"""The typed boundary between a controller and its device workers holds: `DeviceWorker` implements
every `WorkerAPI` method with the same parameters, and handles refuse methods named by string."""

from __future__ import annotations

import inspect

import pytest

from gcore_rl.controller.handles import LocalHandle, result
from gcore_rl.controller.worker_api import WorkerAPI
from gcore_rl.runtime.device_worker import DeviceWorker


def _parameters(function) -> list[inspect.Parameter]:
    """The declared parameters; once a Ray actor class derived from `DeviceWorker` has been created in
    this process, Ray's tracing wraps the inherited methods and appends `_ray_trace_ctx`, which is Ray's."""
    return [p for p in inspect.signature(function).parameters.values() if p.name != "_ray_trace_ctx"]


def _api_methods() -> list[str]:
    return [name for name, member in vars(WorkerAPI).items() if inspect.isfunction(member) and not name.startswith("_")]


@pytest.mark.parametrize("name", _api_methods())
def test_device_worker_implements_the_protocol_method(name):
    declared, implemented = getattr(WorkerAPI, name), getattr(DeviceWorker, name)
    assert [p.name for p in _parameters(implemented)] == [p.name for p in _parameters(declared)]
    assert [p.default for p in _parameters(implemented)] == [p.default for p in _parameters(declared)]
    assert inspect.signature(implemented).return_annotation == inspect.signature(declared).return_annotation


def test_every_method_the_controller_calls_is_in_the_protocol():
    assert {"generate_stream", "score_samples", "reference_logprobs", "train", "critic_step", "sync_weights", "publish_weights", "load_weights",
            "begin_step", "device_load", "rollout_work", "engine_rounds", "utilisation", "save_checkpoint", "finish_checkpoint", "load_checkpoint",
            "save_policy", "close"} == set(_api_methods())


def test_handles_dispatch_by_reference_and_refuse_strings():
    class Worker:
        def begin_step(self, step):
            return step * 2

    handle = LocalHandle(Worker())
    assert result(handle.call(WorkerAPI.begin_step, 21)) == 42
    with pytest.raises(TypeError, match="by reference"):
        handle.call("begin_step", 21)
