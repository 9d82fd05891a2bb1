"""`train.sequence_parallel=2` on 2 gloo processes: the trainer's log-probs, loss and update equal the
single-process ones (issue 21, item 4).

Both ranks form one Ulysses group, get the same rows, and each runs the model on half of every
packed pass. The single-process trainer (no sequence parallelism, padded passes) on the same batch
is the reference: the log-probs `prepare` fills (old, reference), the step's statistics and the
weights after two optimiser steps must agree to float rounding. Ragged rows (left-padded prompts,
right-padded completions), a KL term (the reference runs Ulysses too), an entropy bonus and two
mini-batches exercise every forward the trainer makes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from process_helpers import run_processes

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.distributed import destroy_process_group, init_process_group
from gcore_rl.models.loading import load_tokenizer
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import TrainConfig, full_tensor
from gcore_rl.training.policy_trainer import PolicyTrainer
from gcore_rl.training.sequence_parallel import sequence_parallel_groups

CPU = torch.device("cpu")
SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=7)
WORLD = 2
TIMEOUT_S = 120.0
ALGO = AlgoConfig(kl_coef=0.05, entropy_coef=0.01)


def _train(sequence_parallel: int) -> TrainConfig:
    # micro-batches of 4 rows: a pass's packed row is split unevenly (odd lengths get a padding token)
    return TrainConfig(lr=1e-2, grad_clip=0.5, micro_batch_size=4, mini_batches=2, sequence_parallel=sequence_parallel)


def _batch(tokenizer) -> TokenBatch:
    gen = torch.Generator().manual_seed(3)
    completions = []
    for i in range(8):
        prompt = tokenizer.encode(f"{7 * i}+{i}=" + "x" * (i % 3), add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (1 + (5 * i) % 7,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * len(tokens), "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.advantages = torch.randn(len(completions), generator=gen)
    return batch


def _run(model_dir: Path, sequence_parallel: int) -> dict:
    """prepare + update on the whole batch; what the comparison needs."""
    trainer = PolicyTrainer.build(model_dir, dtype="float32", attn_implementation="sdpa", reference_path=None,
                                  train=_train(sequence_parallel), algo=ALGO, logprob_temperature=0.8, device=CPU,
                                  bf16=False)
    for group in trainer.actor.optimizer.param_groups:
        group["eps"] = 1.0  # AdamW steps ~lr * grad: a linear function of the gradient to compare
    batch = _batch(load_tokenizer(model_dir))
    current = trainer.prepare(batch)
    stats = trainer.update(batch, current)
    weights = {name: tensor.clone() for name, tensor in trainer.full_weights()}
    return {"current": current, "ref": batch.ref_logprobs, "stats": stats, "weights": weights}


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world, port, CPU)
    try:
        torch.save(_run(Path(model_dir), sequence_parallel=world), Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-sp"), SHAPE)


@pytest.mark.slow
def test_a_sequence_parallel_update_equals_the_single_process_update(model_dir, tmp_path, process_group):
    run_processes(_worker, (str(model_dir), str(tmp_path)), WORLD, TIMEOUT_S, "sequence-parallel")
    single = _run(model_dir, sequence_parallel=1)  # this process: a gloo group of one (`process_group`)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for result in ranks:  # every rank of the group holds the whole batch's log-probs
        torch.testing.assert_close(result["current"], single["current"], rtol=0, atol=1e-5)
        torch.testing.assert_close(result["ref"], single["ref"], rtol=0, atol=1e-5)
        for key in ("pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "rollout/logprob_gap_max"):
            assert result["stats"][key] == pytest.approx(single["stats"][key], rel=1e-4, abs=1e-6), key
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    moved = max(float((single["weights"][n] - full_tensor(t).detach()).abs().max()) for n, t in
                _initial_weights(model_dir).items())
    assert moved > 1e-3  # the update did something to compare


def _initial_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from gcore_rl.models.loading import load_causal_lm
    return dict(load_causal_lm(model_dir, "float32", "sdpa", CPU).named_parameters())


def test_groups_are_consecutive_ranks_and_must_divide_the_trainers():
    assert sequence_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    assert sequence_parallel_groups(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="degree of 2 does not divide 3 trainer ranks"):
        sequence_parallel_groups(3, 2)
