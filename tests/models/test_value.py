"""The PPO critic: per-token values, padding independence, the two starting points, save/load, and a fit.

Tiny models (hidden 32, 2 layers) on one thread (see `folders`). The fit test is a learning claim: bodies seeded 3
to 7 all end at explained variance 0.98 or more on its fixed batch (see the test).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from gcore_rl.algos.value_loss import clipped_value_loss, explained_variance, value_targets
from gcore_rl.errors import ModelLoadError
from gcore_rl.models.loading import load_tokenizer, quiet_hf_libraries, save_model_dir
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model, write_tiny_reward_model
from gcore_rl.models.value import load_value_model, position_values, token_values, value_source
from gcore_rl.records import RewardInput
from gcore_rl.rewards.reward_model import RewardModelConfig, ScalarRewardModel, left_pad

quiet_hf_libraries()
TEXTS = ["12+30=42", "7+8=15", "99+99=198", "1+1=3"]


def small(arch: str = "llama", seed: int = 3) -> TinyModelConfig:
    return TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=seed, arch=arch)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny policy folder and tiny reward-model folders (llama, qwen2), which every test here uses.

    While they are in use, torch runs one intra-op thread: the models are tiny, and OpenMP teams only
    stall on a busy machine (2 threads on 2 shared cores made this file 6x slower).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("critic")
    yield {"policy": write_tiny_model(root / "policy", small()),
           **{f"rm-{arch}": write_tiny_reward_model(root / f"rm-{arch}", small(arch)) for arch in ("llama", "qwen2")}}
    torch.set_num_threads(threads)


def _encode(path, texts=TEXTS) -> list[list[int]]:
    tokenizer = load_tokenizer(path)
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _batch(path, texts=TEXTS):
    ids, mask, _ = left_pad(_encode(path, texts), load_tokenizer(path).pad_token_id)
    return ids, mask


def test_the_folder_kind_decides_the_start(folders, tmp_path):
    assert value_source(folders["policy"]) == "causal_lm"
    assert value_source(folders["rm-llama"]) == "reward_model"
    config = json.loads((folders["policy"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    (tmp_path / "model.safetensors").write_bytes((folders["policy"] / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="cannot start a critic"):
        value_source(tmp_path)
    two_labels = {**config, "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}
    (tmp_path / "config.json").write_text(json.dumps(two_labels))
    with pytest.raises(ModelLoadError, match="2 labels"):
        value_source(tmp_path)


def test_from_the_policy_the_head_is_zero_and_values_have_one_entry_per_token(folders):
    critic = load_value_model(folders["policy"])
    assert type(critic).__name__ == "LlamaForTokenClassification"
    assert not critic.score.weight.any() and not critic.score.bias.any()
    ids, mask = _batch(folders["policy"])
    values = position_values(critic, ids, mask)
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert not values.any()  # a zero head: every value starts at exactly 0
    # the body is the policy's
    lm = AutoModelForCausalLM.from_pretrained(folders["policy"], local_files_only=True)
    torch.testing.assert_close(critic.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_from_a_reward_model_the_last_value_is_the_reward_models_score(folders, arch):
    path = folders[f"rm-{arch}"]
    critic = load_value_model(path)
    assert not critic.score.bias.any()
    rm = ScalarRewardModel.from_config(RewardModelConfig(enabled=True, model_path=str(path), transform="raw"))
    samples = [RewardInput(text.split("=")[0] + "=", text.split("=")[1], {}) for text in TEXTS]
    ids, mask = _batch(path)
    with torch.no_grad():
        last = position_values(critic.train(), ids, mask)[:, -1]  # train mode: no dropout either
    assert last.tolist() == pytest.approx(rm.raw_scores(samples), abs=1e-5)
    assert len({round(v, 5) for v in last.tolist()}) == len(TEXTS)  # different texts, different values


def test_a_rows_values_do_not_depend_on_its_batch(folders):
    path = folders["rm-llama"]
    critic = load_value_model(path)
    pad = load_tokenizer(path).pad_token_id
    rows = _encode(path)
    with torch.no_grad():
        ids, mask = _batch(path)
        batched = position_values(critic, ids, mask)
        # the trainer's layout: left padding before the row and right padding after it
        width = ids.shape[1] + 3
        for index, row in enumerate(rows):
            alone_ids, alone_mask, _ = left_pad([row], pad)
            alone = position_values(critic, alone_ids, alone_mask)[0]
            torch.testing.assert_close(batched[index, -len(row):], alone, rtol=0, atol=1e-5)
            start = width - len(row) - 2
            mixed_ids = torch.full((1, width), pad)
            mixed_ids[0, start:start + len(row)] = torch.tensor(row)
            mixed_mask = (torch.arange(width) >= start) & (torch.arange(width) < start + len(row))
            mixed = position_values(critic, mixed_ids, mixed_mask.long().unsqueeze(0))[0]
            torch.testing.assert_close(mixed[start:start + len(row)], alone, rtol=0, atol=1e-5)
            assert not mixed[:start].any() and not mixed[start + len(row):].any()  # 0 on padding


def test_token_values_are_the_values_of_the_state_before_each_token(folders):
    critic = load_value_model(folders["rm-llama"])
    ids, mask = _batch(folders["rm-llama"])
    with torch.no_grad():
        at = position_values(critic, ids, mask)
        before = token_values(critic, ids, mask)
        from_column_5 = token_values(critic, ids, mask, first_scored=5)
    assert before.shape == ids.shape
    torch.testing.assert_close(before[:, 1:], at[:, :-1], rtol=0, atol=0)
    assert not before[:, 0].any()
    torch.testing.assert_close(from_column_5[:, 5:], before[:, 5:], rtol=0, atol=0)
    assert not from_column_5[:, :5].any()


def test_save_and_load_round_trip(folders, tmp_path):
    critic = load_value_model(folders["policy"])
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.25)
    out = save_model_dir(critic, load_tokenizer(folders["policy"]), tmp_path / "critic")
    assert (out / "model.safetensors").is_file()
    assert value_source(out) == "value_model"
    again = load_value_model(out)
    ids, mask = _batch(folders["policy"])
    with torch.no_grad():
        torch.testing.assert_close(position_values(again, ids, mask), position_values(critic, ids, mask), rtol=0, atol=0)
    for (name, saved), (_, loaded) in zip(critic.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(saved, loaded), name


def _fit_batch(path):
    """Eight prompts with a 3-token answer each; the reward: 1 when the sum is right, 0 when not."""
    texts = ["12+30=042", "7+8=015", "99+99=198", "1+1=003", "40+2=042", "5+5=011", "3+4=007", "9+9=017"]
    ids, mask = _batch(path, texts)
    response = torch.zeros_like(mask)
    response[:, -3:] = 1
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    return ids, mask, response, rewards


def test_a_few_steps_fit_the_returns(folders):
    """10 rounds x 4 Adam steps (lr 3e-3, value clip 0.5, old values refreshed each round as after a rollout).

    The value loss starts at 0.5 * mean(R^2) = 0.5 * 5/8 = 0.3125 (all values 0). Measured on bodies seeded
    3 to 7 (1 thread): explained variance 0 -> 0.981-0.996 and loss 0.3125 -> 0.0004-0.0023 (seed 3, the
    one used here: 0.981 and 0.0023). The bounds asked (EV > 0.8, loss below a tenth) leave a wide margin.
    """
    torch.manual_seed(0)
    critic = load_value_model(folders["policy"]).train()
    ids, mask, response, rewards = _fit_batch(folders["policy"])
    with torch.no_grad():
        start_values = token_values(critic, ids, mask)
    _, returns = value_targets(rewards, start_values, response, gamma=1.0, lam=1.0)
    first_loss, _ = clipped_value_loss(start_values, start_values, returns, response, value_clip=0.5)
    assert explained_variance(start_values, returns, response).item() == pytest.approx(0.0)  # values all 0
    optimizer = torch.optim.Adam(critic.parameters(), lr=3e-3)
    for _ in range(10):
        with torch.no_grad():
            old_values = token_values(critic, ids, mask)
        for _ in range(4):
            loss, _ = clipped_value_loss(token_values(critic, ids, mask), old_values, returns, response, value_clip=0.5)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        end_values = token_values(critic, ids, mask)
    end_loss, _ = clipped_value_loss(end_values, end_values, returns, response, value_clip=0.5)
    assert first_loss.item() == pytest.approx(0.3125)
    assert end_loss.item() < 0.1 * first_loss.item()
    assert explained_variance(end_values, returns, response).item() > 0.8
