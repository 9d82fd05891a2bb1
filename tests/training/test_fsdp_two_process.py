"""FSDP2 over a real gloo group of 2: one Actor.update on two halves of a batch equals the whole-batch update,
and a PolicyTrainer resumes exactly from a sharded DCP checkpoint and exports one whole model.

Each rank holds half of every parameter, computes gradients on its own half of the rows, and
FSDP averages the gradients over ranks; the actor all-reduces the loss denominator (valid tokens
for `token_mean`) and scales each rank's loss so that the average is the token mean of the whole
batch even when the halves hold different numbers of tokens. So the sharded 2-process step must
land on the same weights as a plain single-process step on the whole batch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from process_helpers import run_processes

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.distributed import all_reduce_mean, destroy_process_group, init_process_group
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.records import Completion, TokenBatch, build_token_batch
from gcore_rl.training.actor import Actor, TrainConfig, compute_logprobs, full_tensor
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.micro_batches import plan_passes
from gcore_rl.training.policy_trainer import PolicyTrainer
from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer

CPU = torch.device("cpu")
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=11)
WORLD = 2
# ragged rows; the halves hold 15 and 7 response tokens
LENGTHS = [2, 6, 3, 4, 1, 3, 1, 2]
ADVANTAGES = [1.0, -0.7, 0.4, -1.2, 0.9, -0.3, 1.5, -0.6]
TRAIN = {"lr": 1e-2, "grad_clip": 0.5, "micro_batch_size": 3}
TIMEOUT_S = 120.0  # one spawn runs every two-rank case (`two_rank_runs`)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda detail: f"{name}: {detail}")


def _model():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(SMALL, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)


def _batch() -> TokenBatch:
    """The fixed batch, with old log-probs = the initial policy's, perturbed so that some ratios clip."""
    tokenizer = build_char_tokenizer()
    gen = torch.Generator().manual_seed(0)
    completions = []
    for i, length in enumerate(LENGTHS):
        prompt = tokenizer.encode(f"{13 * i}+{i}=" + " " * (i % 2), add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (length,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * length, "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.advantages = torch.tensor(ADVANTAGES)
    # the same unsharded forward in every process, so every process starts from identical old log-probs
    old = compute_logprobs(_model(), batch, temperature=1.0, batching=64, device=CPU)
    batch.old_logprobs = old + 0.2 * torch.randn(old.shape, generator=gen) * batch.response_mask
    return batch


def _actor(model, train: dict | None = None) -> Actor:
    actor = Actor(model, TrainConfig(**(train or TRAIN)), AlgoConfig(loss_aggregation="token_mean"), 1.0, CPU)
    # AdamW with eps=1 steps ~lr * grad (linear in the gradient, like SGD), so the comparison is not
    # at the mercy of float noise in gradient components near 0 (default eps gives ~lr * sign(grad))
    for group in actor.optimizer.param_groups:
        group["eps"] = 1.0
    return actor


def _update_halves(rank: int, world: int, out: Path, train: dict | None = None) -> None:
    """One Actor.update of this rank's half of the batch, with `train`'s settings."""
    actor = _actor(shard_model(_model()), train)
    batch = _batch()
    rows = batch.size // world
    half = batch.select(slice(rank * rows, (rank + 1) * rows))
    batching = actor.train_cfg.batching
    planned = len(plan_passes(half.attention_mask.sum(-1).tolist(), batching.rows, batching.max_tokens,
                              batching.packed))
    stats = actor.update(half)
    reduced = all_reduce_mean(stats, CPU)
    probe = all_reduce_mean({"rank": float(rank), "scaled": 10.0 * rank + 1.0, "gap_max": 3.0 - rank,
                             "count": 2.0 + rank}, CPU, sum_keys={"count"})
    # every rank must consume full_weights(): gathering a shard is a collective
    weights = {name: tensor.clone() for name, tensor in actor.full_weights()}
    torch.save({"stats": stats, "reduced": reduced, "probe": probe, "weights": weights, "planned": planned,
                "tokens": float(half.response_mask.sum())}, out / f"rank{rank}.pt")


def _spawn(out_dir: Path, worker, world: int = WORLD) -> None:
    run_processes(worker, (str(out_dir),), world, TIMEOUT_S, "FSDP")


def _in_group(bodies: dict[str, object], rank: int, world: int, port: int, out_dir: str) -> None:
    """Run each body `(rank, world, out)` in turn in one process group (its own folder `out_dir/<name>`): one
    spawn of the ranks for every two-rank case, not one per case."""
    torch.set_num_threads(1)
    init_process_group(rank, world, port, CPU)
    try:
        for name, body in bodies.items():
            out = Path(out_dir) / name
            out.mkdir(exist_ok=True)
            body(rank, world, out)
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The folder of every two-rank case's results (see `TWO_RANK_CASES`)."""
    out = tmp_path_factory.mktemp("fsdp")
    _spawn(out, functools.partial(_in_group, TWO_RANK_CASES))
    return out


@pytest.fixture(scope="module")
def two_process_results(two_rank_runs):
    return [torch.load(two_rank_runs / "padded" / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single_process_reference():
    """The same step on the whole batch with a plain (unsharded) model in this process, no group needed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model()
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        actor = _actor(model)
        stats = actor.update(_batch())
        return stats, initial, {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


# packed passes under a token budget: rank 0's rows need more passes than rank 1's, so rank 1 splits
# one of its passes to keep FSDP's collectives paired; the update must still equal the padded whole-batch one
PACKED = {**TRAIN, "packing": True, "max_tokens_per_micro_batch": 16}  # passes: rank 0 three, rank 1 two


@pytest.fixture(scope="module")
def packed_two_process_results(two_rank_runs):
    return [torch.load(two_rank_runs / "packed" / f"rank{rank}.pt") for rank in range(WORLD)]


def test_packed_token_budget_update_on_two_ranks_equals_the_padded_single_process_update(
        packed_two_process_results, single_process_reference):
    planned = [result["planned"] for result in packed_two_process_results]
    assert planned[0] != planned[1], f"both ranks planned {planned[0]} passes: the equalising is not exercised"
    _, _, expected = single_process_reference
    for result in packed_two_process_results:
        for name, value in result["weights"].items():
            _assert_close(value, expected[name], rtol=0, atol=1e-5, name=name)


def test_halves_have_unequal_token_counts(two_process_results):
    assert two_process_results[0]["tokens"] == 15 and two_process_results[1]["tokens"] == 7


def test_two_rank_update_equals_single_process_whole_batch_update(two_process_results, single_process_reference):
    ref_stats, initial, expected = single_process_reference
    for result in two_process_results:
        weights = result["weights"]
        assert list(weights) == list(expected)
        for name, value in weights.items():
            assert value.shape == expected[name].shape, name
            _assert_close(value, expected[name], rtol=0, atol=1e-5, name=name)
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-4, "the step barely moved the weights; the comparison would be vacuous"
    # the clip saw the global norm of the averaged gradient, not a per-rank or per-shard one
    assert ref_stats["grad_norm"] > TRAIN["grad_clip"]
    for result in two_process_results:
        assert result["stats"]["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)


def test_ranks_end_with_identical_full_weights(two_process_results):
    first, second = (result["weights"] for result in two_process_results)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_all_reduce_mean_averages_metric_dicts(two_process_results):
    for result in two_process_results:
        # means are averaged, keys ending in `max` take the maximum over ranks, sum_keys add up
        assert result["probe"] == pytest.approx({"rank": 0.5, "scaled": 6.0, "gap_max": 3.0, "count": 5.0})
        per_rank = [r["stats"] for r in two_process_results]
        assert result["reduced"].keys() == per_rank[0].keys()
        for key, value in result["reduced"].items():
            pair = (per_rank[0][key], per_rank[1][key])
            expected = max(pair) if key.endswith("max") else sum(pair) / 2
            assert value == pytest.approx(expected, rel=1e-9, abs=1e-12), key
    # the two halves really did differ, so the average is not trivially either rank's value
    assert two_process_results[0]["stats"]["entropy"] != pytest.approx(two_process_results[1]["stats"]["entropy"])


def test_loss_statistics_are_global_on_every_rank(two_process_results, single_process_reference):
    """Loss terms are all-reduced inside the update: each rank reports the whole batch's loss."""
    ref_stats = single_process_reference[0]
    for result in two_process_results:
        assert result["stats"]["pg_loss"] == pytest.approx(ref_stats["pg_loss"], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------------- PolicyTrainer

KL_COEF = 0.1


def _policy_trainer() -> PolicyTrainer:
    actor = Actor(shard_model(_model()), TrainConfig(**TRAIN), AlgoConfig(kl_coef=KL_COEF), 1.0, CPU)
    return PolicyTrainer(actor, shard_model(_model().requires_grad_(False)))


def _train_half(trainer: PolicyTrainer, rank: int, world: int) -> dict[str, float]:
    batch = _batch()
    rows = batch.size // world
    half = batch.select(slice(rank * rows, (rank + 1) * rows))
    return trainer.update(half, trainer.prepare(half))


def _resume_trainer(rank: int, world: int, out: Path) -> None:
    """One update, a sharded DCP save, a fresh trainer resumed from it, the same second update on both."""
    first = _policy_trainer()
    _train_half(first, rank, world)
    dcp.save(first.state_dict(), checkpoint_id=out / "checkpoint")
    checkpointer = TrainerCheckpointer("background")
    checkpointer.save(first, out / "async", "trainer", "trainer.json")  # written while the next update runs
    assert checkpointer.last_in_background
    saved_state = _full_state(first)
    resumed = _policy_trainer()
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=out / "checkpoint")
    resumed.load_state_dict(state)
    stats = [_train_half(trainer, rank, world) for trainer in (first, resumed)]
    weights = [{name: tensor.clone() for name, tensor in trainer.full_weights()} for trainer in (first, resumed)]
    checkpointer.close()
    first.export(out / "export", build_char_tokenizer())
    torch.save({"stats": stats, "saved_state": saved_state, "weights": weights, "export_complete": (out / "export" / "config.json").is_file()},
               out / f"trainer-rank{rank}.pt")


def _full_state(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Full parameters and AdamW state by name (a collective: every rank calls it)."""
    state = trainer.state_dict()
    flat = {f"model/{name}": full_tensor(value).detach().clone() for name, value in state["model"].items()}
    for name, per_param in state["optimizer"]["state"].items():
        flat.update({f"optimizer/{name}/{key}": full_tensor(value).detach().clone() for key, value in per_param.items()})
    return flat


def _reshard_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """A fresh trainer on `world` ranks loads the 2-rank checkpoint, then takes the same second update."""
    torch.set_num_threads(1)
    init_process_group(rank, world, port, CPU)
    out = Path(out_dir)
    try:
        resumed = _policy_trainer()
        TrainerCheckpointer().load(resumed, out / "async", "trainer", "trainer.json")
        loaded, steps = _full_state(resumed), resumed.optimiser_steps
        stats = _train_half(resumed, rank, world)
        if rank == 0:
            torch.save({"loaded": loaded, "stats": stats, "optimiser_steps": steps},
                       out / f"resharded-{world}.pt")
    finally:
        destroy_process_group()


@pytest.fixture(scope="module")
def trainer_results(two_rank_runs):
    out = two_rank_runs / "trainer"
    return out, [torch.load(out / f"trainer-rank{rank}.pt") for rank in range(WORLD)]


def test_two_rank_trainer_resumes_exactly_from_a_sharded_checkpoint(trainer_results):
    _, results = trainer_results
    for result in results:
        first, resumed = result["weights"]
        assert first.keys() == resumed.keys()
        for name in first:
            assert torch.equal(first[name], resumed[name]), name
        assert result["stats"][0] == result["stats"][1]
    # the loss terms are global: every rank reports the same, and the KL to the reference is on
    kl, pg_loss = ({r["stats"][0][key] for r in results} for key in ("kl", "pg_loss"))
    assert len(kl) == 1 and len(pg_loss) == 1, (kl, pg_loss)
    assert kl.pop() > 0


def test_two_rank_export_writes_the_whole_model_once(trainer_results):
    out, results = trainer_results
    assert all(result["export_complete"] for result in results), "export returned before the folder was written"
    exported = dict(load_causal_lm(out / "export").named_parameters())
    expected = results[0]["weights"][0]
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name].detach(), tensor), name


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_two_rank_checkpoint_reloads_on_another_number_of_trainers(trainer_results, world):
    """DCP reshards on load: 1 or 4 trainers hold exactly what 2 saved, and take the same next update."""
    out, results = trainer_results
    _spawn(out, _reshard_worker, world)
    resharded = torch.load(out / f"resharded-{world}.pt")
    saved = results[0]["saved_state"]
    assert resharded["loaded"].keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(resharded["loaded"][name], tensor), name
    assert resharded["optimiser_steps"] == 1
    uninterrupted = results[0]["stats"][0]
    # the same update on the same rows: only the order of the sums over ranks differs
    for key in ("pg_loss", "kl"):
        assert resharded["stats"][key] == pytest.approx(uninterrupted[key], abs=1e-5), key


# ------------------------------------------------------------------------- batch statistics of PPO's critic


def _critic_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values, returns, mask [6, 5]: the halves hold different numbers of valid tokens."""
    gen = torch.Generator().manual_seed(4)
    mask = torch.zeros(6, 5)
    for row, length in enumerate([5, 1, 2, 4, 0, 3]):
        mask[row, :length] = 1.0
    return torch.randn(6, 5, generator=gen), 2.0 + torch.randn(6, 5, generator=gen), mask


def _critic_statistics(rank: int, world: int, out: Path) -> None:
    from gcore_rl.training.critic import global_explained_variance, global_whiten

    values, returns, mask = (t[rank * 3:(rank + 1) * 3] for t in _critic_tensors())
    torch.save({"whitened": global_whiten(returns, mask, CPU),
                "explained": global_explained_variance(values, returns, mask, CPU)}, out / f"rank{rank}.pt")


def test_advantage_whitening_and_explained_variance_span_every_trainer_rank(two_rank_runs):
    from gcore_rl.algos.masked import masked_whiten
    from gcore_rl.algos.value_loss import explained_variance

    results = [torch.load(two_rank_runs / "statistics" / f"rank{rank}.pt") for rank in range(WORLD)]
    values, returns, mask = _critic_tensors()
    whole = masked_whiten(returns, mask)
    _assert_close(torch.cat([r["whitened"] for r in results]), whole, rtol=0, atol=1e-6, name="whitened")
    # each half whitened alone would differ: the test is not vacuous
    assert not torch.allclose(masked_whiten(returns[:3], mask[:3]), whole[:3], atol=1e-3)
    for result in results:
        assert result["explained"] == pytest.approx(float(explained_variance(values, returns, mask)), abs=1e-6)


TWO_RANK_CASES = {"padded": _update_halves, "packed": functools.partial(_update_halves, train=PACKED),
                  "trainer": _resume_trainer, "statistics": _critic_statistics}
"""The two-rank cases, run in one spawn of the ranks (`two_rank_runs`), each writing to its own folder."""
