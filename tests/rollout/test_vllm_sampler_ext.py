"""The worker extension's sampler wrapper (`vllm_ext/gcore_vllm_sampler.py`) without vLLM: a stand-in for vLLM's
top-k/top-p step (which filters its logits in place and reports log-probs renormalised over the kept tokens) is
wrapped, and the log-probs come back before the truncation while the samples are unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gcore_rl.rollout.sampling import filter_logits
from gcore_rl.rollout.vllm_ext.gcore_vllm_sampler import SamplerExtension, untruncated


def _vllm_like(logits, generators, k, p):
    """Like vLLM's `TopKTopPSampler.forward_native` in `processed_logprobs` mode: filters `logits` in place."""
    if k is not None or p is not None:
        logits.copy_(filter_logits(logits, int(k[0]) if k is not None else 0, float(p[0]) if p is not None else 1.0))
    processed = logits.log_softmax(dim=-1, dtype=torch.float32)
    return logits.argmax(-1), processed


def test_truncating_steps_report_the_logprobs_of_the_logits_they_were_given():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    full = logits.log_softmax(-1)
    sampled, logprobs = untruncated(_vllm_like)(logits.clone(), {}, None, torch.full((3,), 0.5))
    assert torch.equal(sampled, _vllm_like(logits.clone(), {}, None, torch.full((3,), 0.5))[0])
    assert torch.allclose(logprobs, full)
    # without the wrapper the kept tokens' log-probs are higher by −log(kept mass)
    _, renormalised = _vllm_like(logits.clone(), {}, None, torch.full((3,), 0.5))
    kept = torch.isfinite(renormalised)
    mass = full.exp().where(kept, 0).sum(-1, keepdim=True)
    assert torch.allclose((renormalised - full)[kept], (-mass.log()).expand_as(full)[kept], atol=1e-5)
    # top-k alike; without truncation the step is left as it is
    assert torch.allclose(untruncated(_vllm_like)(logits.clone(), {}, torch.full((3,), 4), None)[1], full)
    assert torch.equal(untruncated(_vllm_like)(logits.clone(), {}, None, None)[1], full)


def test_the_extension_wraps_a_v1_sampler_once_and_says_why_it_cannot_otherwise():
    step = SimpleNamespace(logprobs_mode="processed_logprobs", forward=_vllm_like)
    worker = SimpleNamespace(model_runner=SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=step)))
    assert SamplerExtension.gcore_untruncated_logprobs(worker) == ""
    wrapped = step.forward
    assert wrapped is not _vllm_like and SamplerExtension.gcore_untruncated_logprobs(worker) == ""
    assert step.forward is wrapped  # not wrapped twice
    step.logprobs_mode = "raw_logprobs"
    assert "raw_logprobs" in SamplerExtension.gcore_untruncated_logprobs(worker)
    assert "V1" in SamplerExtension.gcore_untruncated_logprobs(SimpleNamespace(model_runner=SimpleNamespace()))
