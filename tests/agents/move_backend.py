"""An engine backend for environment tests (`engine.backend=move_backend:build`): every turn is a GuessTheNumber
move `[k]` and the end-of-turn token, k drawn from the request's seed, with the policy model's own log-probs of
those tokens (log_softmax(logits / T), the protocol's), so a short run plays whole episodes from a random tiny
model and the trainer's log-probs match the engine's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from fake_backend import HFGenerateEngine  # noqa: E402  (tests/rollout/fake_backend.py)

from gcore_rl.models.loading import load_causal_lm  # noqa: E402
from gcore_rl.models.tiny import build_char_tokenizer  # noqa: E402
from gcore_rl.records import Completion  # noqa: E402

HIGHEST = 16


def build(cfg, source):
    model = load_causal_lm(source.model_path, source.dtype, source.attn_implementation, source.device)
    return MoveEngine(model, source.eos_id, source.pad_id, Path(source.model_path) / "move_backend_calls.txt")


class MoveEngine(HFGenerateEngine):
    tokenizer = build_char_tokenizer()

    @torch.no_grad()
    def _samples(self, index, prompt, limit, params, seed):
        rng = random.Random(f"{seed} {index}")
        completions = []
        for sample in range(params.n):
            move = self.tokenizer.encode(f"[{rng.randint(1, HIGHEST)}]", add_special_tokens=False) + [self.eos_id]
            tokens = move[:limit]
            ids = torch.tensor([list(prompt) + tokens])
            logits = self.model(ids).logits[0, len(prompt) - 1:-1].float() / params.logprob_temperature
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
            completions.append(Completion(prompt_index=index, prompt_ids=list(prompt), token_ids=tokens,
                                          logprobs=logprobs.tolist(), finish_reason="stop" if tokens == move else "length",
                                          policy_version=self.policy_version, sample_index=sample))
        return completions
