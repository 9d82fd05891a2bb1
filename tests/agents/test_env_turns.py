"""Environment rollouts: `env_turns` plays an episode per sample, the environment's answers inserted as user turns
(masked), each turn's reward at the turn's last token; the textarena adapter; rewards into GRPO and GAE."""

from __future__ import annotations

import random

import pytest
import torch
from scripted_engine import ScriptedEngine

from gcore_rl.agents.env_turns import env_turns
from gcore_rl.agents.environments import environment_factory
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.algos.value_loss import value_targets
from gcore_rl.errors import ConfigError, DataError, RolloutError
from gcore_rl.models.tiny import build_char_tokenizer
from gcore_rl.records import Completion, EpisodePrompt, build_token_batch
from gcore_rl.rollout.functions import RolloutRequest, checked_rollout
from gcore_rl.rollout.sampling import SamplingConfig

ECHO = "test_envs:Echo"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _prompts(tokenizer, name=ECHO, seeds=(3, 5), options=None):
    out = []
    for seed in seeds:
        spec = {"name": name, "seed": seed, **({"options": options} if options else {})}
        opening = environment_factory(name, options)().reset(spec) if name == ECHO else [{"role": "user", "content": "go"}]
        text = tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
        out.append(EpisodePrompt(tokenizer.encode(text, add_special_tokens=False), spec))
    return out


def _play(tokenizer, engine, prompts, n=2, max_new_tokens=100, **options) -> list[Completion]:
    request = RolloutRequest(engine, prompts, SamplingConfig(n=n, max_new_tokens=max_new_tokens), seed=0,
                             tokenizer=tokenizer, options=options)
    done = [c for chunk in checked_rollout(env_turns(request), len(prompts), n, "env_turns") for c in chunk]
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))


def test_an_episode_is_the_policys_turns_with_the_environments_answers_masked_and_rewards_at_turn_ends(tokenizer):
    engine = ScriptedEngine(tokenizer, ["3<eos>", "7<eos>"])  # right for seed 3's first ask, wrong for its second
    completions = _play(tokenizer, engine, _prompts(tokenizer))
    first, second = engine.turns
    answer = TurnRenderer(tokenizer, role="user").message_ids([{"role": "user", "content": "say 4"}])
    assert tokenizer.decode(answer) == "U:say 4\nA:"
    for c in completions[:2]:  # seed 3: asked 3 then 4
        assert c.token_ids == first + answer + second
        assert c.loss_mask == [1] * len(first) + [0] * len(answer) + [1] * len(second)
        assert c.turn_rewards == [(len(first) - 1, 1.0), (len(c.token_ids) - 1, 0.0)]
        assert c.environment_reward == 1.0
        assert c.rollout_stats == {"turns": 2.0, "env_errors": 0.0, "episodes_done": 1.0, "env_reward": 1.0}
    for c in completions[2:]:  # seed 5: asked 5 then 6, answered 3 and 7
        assert c.environment_reward == 0.0 and c.rollout_stats["episodes_done"] == 1.0
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    start = batch.input_ids.shape[1] - len(completions[0].token_ids)
    assert batch.turn_rewards[0, start + len(first) - 1] == 1.0 and float(batch.turn_rewards.sum()) == 2.0
    assert int(batch.response_mask.sum()) == 4 * (len(first) + len(second))


def test_episodes_end_at_max_turns_at_a_cut_turn_and_when_the_answer_does_not_fit(tokenizer):
    looping = _play(tokenizer, ScriptedEngine(tokenizer, ["3<eos>"] * 5), _prompts(tokenizer),
                    max_turns=1)
    assert all(c.rollout_stats["turns"] == 1.0 and c.rollout_stats["episodes_done"] == 0.0 for c in looping)
    assert all(c.turn_rewards is not None and len(c.turn_rewards) == 1 for c in looping)  # the turn it played
    cut = _play(tokenizer, ScriptedEngine(tokenizer, ["33333"]), _prompts(tokenizer), max_new_tokens=3)
    assert all(c.finish_reason == "length" and c.turn_rewards is None and c.rollout_stats["turns"] == 1.0 for c in cut)
    no_room = _play(tokenizer, ScriptedEngine(tokenizer, ["3<eos>", "4<eos>"]), _prompts(tokenizer), max_new_tokens=8)
    assert all(c.finish_reason == "length" and c.rollout_stats["turns"] == 1.0 and 0 not in c.loss_mask for c in no_room)


def test_an_environment_that_raises_ends_its_episode_and_is_counted_never_the_run(tokenizer):
    for name in ("test_envs:FailsAtStep", "test_envs:FailsAtReset"):
        completions = _play(tokenizer, ScriptedEngine(tokenizer, ["3<eos>", "4<eos>"]), _prompts(tokenizer, name))
        assert all(c.rollout_stats["env_errors"] == 1.0 and c.rollout_stats["turns"] == 1.0 for c in completions)
        assert all(c.turn_rewards is None for c in completions)


def test_a_prompt_without_an_environment_and_an_unknown_environment_are_named(tokenizer):
    engine = ScriptedEngine(tokenizer, ["3<eos>"])
    with pytest.raises(RolloutError, match="prompt 0 has no environment.*`env` column"):
        _play(tokenizer, engine, [tokenizer.encode("U:x\nA:", add_special_tokens=False)])
    with pytest.raises(DataError, match="`env` column of prompt 0 .*no_such_envs:Game.*names no environment.*cannot import"):
        _play(tokenizer, ScriptedEngine(tokenizer, ["3<eos>"]), _prompts(tokenizer, "no_such_envs:Game", seeds=(1,)))
    with pytest.raises(ConfigError, match="rollout.options.max_turns"):
        _play(tokenizer, ScriptedEngine(tokenizer, ["3<eos>"]), _prompts(tokenizer), max_turns=0)


def test_gae_credits_each_turn_at_its_token_and_group_estimators_see_the_sum():
    """Two turns rewarded 1 and 0.5, the second turn after two masked tokens: GAE over the token rewards equals
    GAE with the first turn's reward placed by hand; the outcome reward stays on the last token."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    values = torch.tensor([[0.2, 0.1, 0.0, 0.0, 0.3, 0.4]])
    turns = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.5]])
    adv, ret = value_targets(torch.tensor([0.25]), values, mask, gamma=0.9, lam=0.8, whiten_advantages=False,
                             turn_rewards=turns)
    by_hand = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.75]])  # the outcome 0.25 on the last token
    keep = mask.bool()[0]
    expected_adv, expected_ret = value_targets(torch.tensor([0.0]), values[:, keep], mask[:, keep], gamma=0.9, lam=0.8,
                                               whiten_advantages=False, turn_rewards=by_hand[:, keep])
    torch.testing.assert_close(adv[:, keep], expected_adv)
    torch.testing.assert_close(ret[:, keep], expected_ret)
    # the first turn's return: its reward, then the discounted rest
    assert float(ret[0, 1]) == pytest.approx(1.0 + 0.9 * (0.8 * float(ret[0, 4]) + 0.2 * float(values[0, 4])))


def test_a_textarena_game_without_the_package_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def without_textarena(name, *args, **kwargs):
        if name == "textarena":
            raise ImportError("No module named 'textarena'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_textarena)
    with pytest.raises(ConfigError, match=r"textarena package is not installed.*pip install 'gcore-rl\[agents\]'"):
        environment_factory("textarena:GuessTheNumber-v0", key="data.task")


textarena = pytest.importorskip("textarena")


def test_a_textarena_game_is_played_turn_by_turn_and_scored_when_it_ends(tokenizer):
    game = environment_factory("textarena:GuessTheNumber-v0", {"max_number": 8, "max_turns": 3})
    env = game()
    [opening] = env.reset({"seed": 11})
    assert opening["role"] == "user" and "between 1 and 8 within 3 turns" in opening["content"]
    target = env.env.state.game_state["game_number"]
    low = env.step(f"I guess [{1 if target != 1 else 2}]")
    assert not low.done and low.reward == 0.0 and low.messages[0]["content"].startswith("The target number is")
    won = env.step(f"[{target}]")
    assert won.done and won.reward == 1.0 and won.messages == []


def test_textarena_games_keep_their_own_random_state(tokenizer):
    game = environment_factory("textarena:GuessTheNumber-v0", {"max_number": 1000})
    alone = game()
    alone.reset({"seed": 5})
    random.seed(123)
    before = random.random()
    random.seed(123)
    a, b = game(), game()
    a.reset({"seed": 5})
    b.reset({"seed": 6})
    assert random.random() == before  # the process's own stream is untouched
    assert a.env.state.game_state["game_number"] == alone.env.state.game_state["game_number"]
    assert a.env.state.game_state["game_number"] != b.env.state.game_state["game_number"]


def test_textarena_names_and_games_that_cannot_be_served_are_config_errors():
    with pytest.raises(ConfigError, match="names no textarena game; did you mean .*GuessTheNumber-v0"):
        environment_factory("textarena:GuessTheNumbr-v0")
    with pytest.raises(ConfigError, match="cannot be played by one player"):
        environment_factory("textarena:TicTacToe-v0")


def test_a_scripted_player_writes_whole_episodes_for_a_warm_start():
    from gcore_rl.data.tasks import make_task_rows

    rows = make_task_rows("textarena:GuessTheNumber-v0", 200, seed=1, max_number=16, max_turns=5,
                          play="gcore_rl.agents.players:guess_randomly")
    assert all("env" not in row and row["messages"][-1]["role"] == "assistant" for row in rows)
    for row in rows:
        moves = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert 1 <= len(moves) <= 6 and len(set(moves)) == len(moves)  # never a number twice (max_turns 5: 6 guesses)
        assert all(m["content"].startswith("The target number is") for m in row["messages"][2::2])
    wins = sum(row["env_reward"] == 1.0 for row in rows) / len(rows)
    assert 0.25 < wins < 0.5  # chance: 6 of 16 numbers tried
    assert make_task_rows("textarena:GuessTheNumber-v0", 3, seed=1, max_number=16)[2]["env"]["seed"] == 1_000_005


def test_the_hint_following_players_keep_to_the_range_the_hints_leave():
    from gcore_rl.agents.players import hint_range
    from gcore_rl.data.tasks import make_task_rows

    opening = {"role": "user", "content": "guess the number between 1 and 8 within 3 turns"}
    moves = [opening, {"role": "assistant", "content": "[4]"}, {"role": "user", "content": "The target number is higher."},
             {"role": "assistant", "content": "[6]"}, {"role": "user", "content": "The target number is lower."}]
    assert hint_range(moves[:1]) == (1, 8) and hint_range(moves[:3]) == (5, 8) and hint_range(moves) == (5, 5)
    # bisecting finds any of 1..8 within four guesses (max_turns 3): every episode won
    rows = make_task_rows("textarena:GuessTheNumber-v0", 40, seed=2, max_number=8, max_turns=3,
                          play="gcore_rl.agents.players:bisect")
    assert all(row["env_reward"] == 1.0 for row in rows)
    assert {row["messages"][1]["content"] for row in rows} == {"[4]"}
    # half_bisect: valid moves only (no invalid-move answers), half of the first guesses bisect
    rows = make_task_rows("textarena:GuessTheNumber-v0", 200, seed=2, max_number=8, max_turns=3,
                          play="gcore_rl.agents.players:half_bisect")
    assert not any("invalid" in m["content"] for row in rows for m in row["messages"] if m["role"] == "user")
    assert 0.45 < sum(row["messages"][1]["content"] == "[4]" for row in rows) / len(rows) < 0.7  # 1/2 + 1/16


def test_an_episode_prompt_is_its_tokens_wherever_tokens_go_and_keeps_its_spec_across_processes():
    import pickle

    prompt = EpisodePrompt([5, 6, 7], {"name": ECHO, "seed": 3})
    assert list(prompt) == [5, 6, 7] and len(prompt) == 3 and prompt == [5, 6, 7] and prompt[1:] == (6, 7)
    again = pickle.loads(pickle.dumps(prompt))
    assert isinstance(again, EpisodePrompt) and again.env == prompt.env and list(again) == [5, 6, 7]


def test_rows_of_a_prompt_file_with_an_env_column_open_episodes(tokenizer):
    from gcore_rl.data.prompts import PromptEncoder
    from gcore_rl.errors import DataError

    encoder = PromptEncoder(tokenizer)
    prompt = encoder({"prompt": "U:say 3\nA:", "env": {"name": ECHO, "seed": 3}})
    assert isinstance(prompt, EpisodePrompt) and prompt.env["seed"] == 3
    assert not isinstance(encoder({"prompt": "U:x\nA:"}), EpisodePrompt)
    with pytest.raises(DataError, match="both images and an `env` column"):
        PromptEncoder(tokenizer, processor=object())({"prompt": "x", "env": {"name": ECHO}, "images": [object()]})
