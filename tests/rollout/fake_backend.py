"""A second engine backend, written only against `gcore_rl.rollout.protocol`: Hugging Face `generate`, one
prompt at a time, no continuous batching and no statistics. Selected by import path
(`engine.backend=fake_backend:build`, this folder on the path), it shows that a backend needs no edit outside
its own module. Every engine it builds appends a line to `CALLS_FILE` in the model's folder, so a test can
tell that generation went through it, in whatever process the engine lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from gcore_rl.models.loading import load_causal_lm
from gcore_rl.records import Completion
from gcore_rl.rollout.backends import EngineConfig, EngineSource
from gcore_rl.rollout.protocol import Continuation, continuation_inputs
from gcore_rl.rollout.sampling import SamplingConfig

CALLS_FILE = "fake_backend_calls.txt"


def build(cfg: EngineConfig, source: EngineSource) -> HFGenerateEngine:
    model = load_causal_lm(source.model_path, source.dtype, source.attn_implementation, source.device)
    return HFGenerateEngine(model, source.eos_id, source.pad_id, Path(source.model_path) / CALLS_FILE)


class HFGenerateEngine:
    """`RolloutEngine` over `model.generate`: the log-prob of each sampled token is `log_softmax(logits / T)` of
    the raw logits `generate` returns (`output_logits`), as the protocol asks."""

    def __init__(self, model, eos_id: int, pad_id: int, calls: Path):
        self.model = model.eval()
        self.eos_id, self.pad_id, self.calls = eos_id, pad_id, calls
        self.policy_version = 0
        self.state = "awake"
        self._parts = 0
        for param in self.model.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def generate_stream(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                        max_new_tokens: Sequence[int] | None = None) -> Iterator[list[Completion]]:
        assert self.state == "awake", self.state
        with self.calls.open("a") as log:
            log.write(f"generate {len(prompts)} prompts x {params.n}\n")
        limits = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        for index, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
            yield self._samples(index, list(prompt), limit, params, None if seed is None else seed + index)

    def _samples(self, index: int, prompt: list[int], limit: int, params: SamplingConfig,
                 seed: int | None) -> list[Completion]:
        ids = torch.tensor([prompt] * params.n)
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit,
                                      do_sample=params.temperature > 0, temperature=params.temperature or None,
                                      top_k=params.top_k, top_p=params.top_p, pad_token_id=self.pad_id,
                                      eos_token_id=None if params.ignore_eos else self.eos_id,
                                      output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, len(prompt):]
        logits = torch.stack(out.logits, dim=1).float() / params.logprob_temperature  # [n, steps, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions = []
        for sample in range(params.n):
            tokens = new[sample].tolist()
            stop = self.eos_id in tokens and not params.ignore_eos
            length = tokens.index(self.eos_id) + 1 if stop else len(tokens)
            completions.append(Completion(prompt_index=index, prompt_ids=prompt, token_ids=tokens[:length],
                                          logprobs=logprobs[sample, :length].tolist(),
                                          finish_reason="stop" if stop else "length",
                                          policy_version=self.policy_version, sample_index=sample))
        return completions

    def generate(self, prompts, params, seed=None, max_new_tokens=None) -> list[Completion]:
        done = [c for chunk in self.generate_stream(prompts, params, seed, max_new_tokens) for c in chunk]
        return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))

    def continue_stream(self, requests: Sequence[Continuation], params: SamplingConfig,
                        seed: int | None = None) -> Iterator[list[Completion]]:
        prompts, single, limits = continuation_inputs(requests, params)
        yield from self.generate_stream(prompts, single, seed, limits)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], final: bool = True,
                     version: int | None = None) -> int:
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            params[name].copy_(tensor)
            self._parts += 1
        if not final:
            return self._parts
        loaded, self._parts = self._parts, 0
        self.policy_version = self.policy_version + 1 if version is None else version
        return loaded

    def load_weights_from_path(self, path, version=None) -> int:
        from safetensors.torch import load_file

        tensors = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
        return self.load_weights(tensors.items(), version=version)

    def sleep(self, level: str = "offload") -> int:
        released = 0 if self.state != "awake" else sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.state = "offloaded" if level == "offload" else "discarded"  # on a CPU there is nothing to move
        return released

    def wake(self) -> None:
        self.state = "awake"

    def take_stats(self) -> None:
        return None  # keeps none: the caller counts from the completions

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(Path(path), safe_serialization=True)
