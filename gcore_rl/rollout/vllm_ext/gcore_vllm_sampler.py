"""Loaded into vLLM's worker processes with the other worker methods (`gcore_vllm_worker.WorkerExtension`):
imports only torch.

Our engine contract reports each sampled token's log-prob after the temperature and before any top-k / top-p
truncation — `log_softmax(logits / T)`, what the trainer recomputes. vLLM's `processed_logprobs` are taken after
the truncation, renormalised over the kept tokens, so with `top_p < 1` or `top_k > 0` each is higher by
−log(kept mass). `gcore_untruncated_logprobs` (called once per server through `/collective_rpc`) wraps the V1
sampler's top-k/top-p step so that, when it truncates, the log-probs it hands back are those of the logits it was
given (after temperature and vLLM's argmax-invariant processors, before the truncation); sampling is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SamplerForward = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


def untruncated(forward: SamplerForward) -> SamplerForward:
    """`forward(logits [R, V], generators, k [R] | None, p [R] | None) -> (sampled [R], logprobs [R, V] | None)`
    returning, where it truncates (`k` or `p` given) and reports log-probs, `log_softmax(logits)` of the logits
    it was given instead (computed before `forward`, which may filter `logits` in place)."""

    def wrapped(logits: torch.Tensor, generators, k: torch.Tensor | None, p: torch.Tensor | None):
        before = None if k is None and p is None else logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, processed = forward(logits, generators, k, p)
        return sampled, (processed if processed is None or before is None else before)

    wrapped.gcore_untruncated = True
    return wrapped


class SamplerExtension:
    """Methods mixed into vLLM's worker class (`self` is the worker: `model_runner`)."""

    def gcore_untruncated_logprobs(self) -> str:
        """Make the worker's sampler report log-probs before top-k / top-p; returns "" once it does, otherwise
        why not (a model runner without vLLM's V1 sampler, or a log-prob mode other than `processed_logprobs`)."""
        sampler = getattr(getattr(getattr(self, "model_runner", None), "sampler", None), "topk_topp_sampler", None)
        if sampler is None:
            return "this vLLM worker's model runner has no V1 top-k/top-p sampler (`model_runner.sampler.topk_topp_sampler`)"
        if sampler.logprobs_mode != "processed_logprobs":
            return f"the server's log-prob mode is {sampler.logprobs_mode}, not processed_logprobs"
        if not getattr(sampler.forward, "gcore_untruncated", False):
            sampler.forward = untruncated(sampler.forward)
        return ""
