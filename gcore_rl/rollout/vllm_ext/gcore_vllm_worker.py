"""The worker extension every vLLM server we start loads (`--worker-extension-cls gcore_vllm_worker.WorkerExtension`,
this folder on the server's `PYTHONPATH`): imports only torch. Its methods are reached through `/collective_rpc`."""

from __future__ import annotations

from gcore_vllm_sampler import SamplerExtension
from gcore_vllm_weights import WeightGroupExtension


class WorkerExtension(WeightGroupExtension, SamplerExtension):
    """`weight_sync=group`'s receiving side and log-probs before top-k / top-p."""
