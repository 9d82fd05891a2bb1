"""Chat-format rows: the tiny template's token ids, the SFT loss mask, GRPO prompts, preference pairs,
local `datasets` folders and Parquet read like JSONL, and bad conversations named by row."""

from __future__ import annotations

import json
import tempfile

import datasets
import pytest

from gcore_rl.cli import main
from gcore_rl.configlib import load_config
from gcore_rl.data.chat import ChatRenderer, render_prompt_rows, resolve_chat_template
from gcore_rl.data.config import DataConfig
from gcore_rl.data.prompts import PromptEncoder
from gcore_rl.data.sources import load_prompt_rows
from gcore_rl.data.tasks import make_task_rows, write_task_jsonl
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.tiny import TINY_CHAT_TEMPLATE, TinyModelConfig, build_char_tokenizer, write_tiny_model
from gcore_rl.training.reward_trainer import RewardTrainConfig, preference_pairs, run_reward_training
from gcore_rl.training.sft import sft_batch, sft_examples

CHAT = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
# "S:add\nU:1+2=\nA:" in the character vocabulary (ids 0-2 special, then 0-9, a-z, A-Z, punctuation, space, newline)
PROMPT_IDS = [57, 80, 13, 16, 16, 98, 59, 80, 4, 75, 5, 83, 98, 39, 80]
REPLY_IDS = [6, 1]  # "3", then <eos> (id 1): the template closes an assistant turn with EOS


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Keep the Arrow cache of prompt files (under the temp dir) inside this test's tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_tiny_template_renders_hand_written_ids_and_the_loss_covers_exactly_the_reply(tokenizer):
    assert tokenizer.chat_template == TINY_CHAT_TEMPLATE
    [example] = sft_examples([{"messages": CHAT}], PromptEncoder(tokenizer), "hand")
    assert (example.prompt_ids, example.target_ids) == (PROMPT_IDS, REPLY_IDS)
    ids, attn, loss_mask = sft_batch([example, *sft_examples([{"prompt": "1+1=", "answer": "2"}], PromptEncoder(tokenizer), "hand")],
                                     tokenizer.pad_token_id)
    assert ids[0].tolist() == PROMPT_IDS + REPLY_IDS and attn[0].sum() == len(PROMPT_IDS) + 2
    assert loss_mask[0].tolist() == [0.0] * len(PROMPT_IDS) + [1.0, 1.0]
    assert loss_mask[1].tolist()[:6] == [0, 0, 0, 0, 1, 1] and loss_mask[1].sum() == 2  # a plain row: answer + EOS


def test_grpo_prompt_is_the_turns_before_the_reply_with_the_generation_prompt(tokenizer):
    renderer = ChatRenderer(tokenizer, TINY_CHAT_TEMPLATE)
    [row] = render_prompt_rows([{"messages": CHAT, "task": "x"}], renderer, "hand", [7])
    assert tokenizer.encode(row["prompt"], add_special_tokens=False) == PROMPT_IDS
    assert row["answer"] == "3" and row["task"] == "x"
    [ends_with_user] = render_prompt_rows([{"messages": CHAT[:2], "answer": "3"}], renderer, "hand", [0])
    assert ends_with_user["prompt"] == row["prompt"]
    plain = {"prompt": "1+1=", "answer": "2"}
    assert render_prompt_rows([plain], None, "hand", [0]) == [plain]


def test_chat_template_override_text_or_file(tokenizer, tmp_path):
    override = ("{% for m in messages %}{% if m.role == 'assistant' %}>{{ m.content }}.{% else %}[{{ m.content }}]"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    assert resolve_chat_template(tokenizer, override, "m") == override
    (tmp_path / "t.jinja").write_text(override)
    assert resolve_chat_template(tokenizer, str(tmp_path / "t.jinja"), "m") == override
    [example] = sft_examples([{"messages": CHAT}], PromptEncoder(tokenizer), "hand", override)
    assert tokenizer.decode(example.prompt_ids + example.target_ids) == "[add][1+2=]>3."
    rewrites = "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(DataError, match="hand, row 0: the chat template renders the conversation differently"):
        sft_examples([{"messages": CHAT}], PromptEncoder(tokenizer), "hand", rewrites)
    with pytest.raises(ConfigError, match="chat_template.*missing.jinja.*is neither a Jinja template .* nor an existing file"):
        DataConfig(chat_template=str(tmp_path / "missing.jinja")).validate()


def test_preference_pairs_from_a_shared_prompt_or_two_conversations_render_alike(tokenizer):
    renderer = ChatRenderer(tokenizer, TINY_CHAT_TEMPLATE)
    explicit = {"messages": CHAT[:2], "chosen": [{"role": "assistant", "content": "3"}], "rejected": "4"}
    implicit = {"chosen": CHAT, "rejected": [*CHAT[:2], {"role": "assistant", "content": "4"}]}
    pairs = preference_pairs([explicit, implicit], "hand", chat=renderer)
    for pair in pairs:
        assert (pair.chosen.prompt, pair.chosen.completion, pair.rejected.completion) == \
            ("S:add\nU:1+2=\nA:", "3<eos>", "4<eos>")
    with pytest.raises(DataError, match="hand, row 0: `chosen` and `rejected` differ before"):
        preference_pairs([{"chosen": CHAT, "rejected": [CHAT[1], CHAT[2]]}], "hand", chat=renderer)


@pytest.mark.parametrize(("messages", "problem"), [
    ([{"role": "function", "content": "x"}, *CHAT], "turn 0 of `messages` has the unknown role 'function'"),
    ([CHAT[0], CHAT[2]], "no user turn"),
    ([CHAT[0], {"role": "user", "content": None}], "turn 1 of `messages` (user) has no text `content`"),
])
def test_a_bad_conversation_is_named_by_file_and_row(tmp_path, messages, problem):
    path = tmp_path / "chat.jsonl"
    good = {"messages": CHAT}
    path.write_text("".join(json.dumps(row) + "\n" for row in (good, good, {"messages": messages}, good)))
    with pytest.raises(DataError, match=f"prompt file {path}, row 2: .*{problem}".replace("(", r"\(").replace(")", r"\)")):
        load_prompt_rows(DataConfig(task=None, path=str(path)), 1, 2)  # every shard checks the whole file


def test_a_template_that_fails_names_the_row_and_the_error(tokenizer):
    strict = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns here') }}"
              "{% endif %}{{ m.content }}{% endfor %}")
    rows = [{"messages": CHAT[1:]}, {"messages": CHAT}]
    with pytest.raises(DataError, match="src, row 1: the chat template failed to render this row .*no system turns here"):
        sft_examples(rows, PromptEncoder(tokenizer), "src", strict)


def test_datasets_folder_parquet_and_jsonl_give_the_same_rows_per_shard(tmp_path):
    jsonl = write_task_jsonl("addition_chat", tmp_path / "chat.jsonl", 9, seed=3, digits=1)
    table = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(tmp_path / "cache"))
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved_dict"))
    for shard in range(2):
        expected = load_prompt_rows(DataConfig(task=None, path=str(jsonl)), shard, 2)
        assert len(expected) == (5 if shard == 0 else 4) and expected[0]["messages"][2]["role"] == "assistant"
        for name in ("chat.parquet", "saved", "saved_dict"):
            cfg = DataConfig(task=None, path=str(tmp_path / name))
            cfg.validate()
            assert load_prompt_rows(cfg, shard, 2) == expected, name
    with pytest.raises(DataError, match="could not read prompt folder .*save_to_disk"):
        (tmp_path / "empty").mkdir()
        load_prompt_rows(DataConfig(task=None, path=str(tmp_path / "empty")))


def test_reward_model_trains_on_both_chat_preference_forms(tmp_path):
    """`gcore-rl rm`'s training function on TRL's explicit-prompt and implicit-prompt chat preference files."""
    write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    forms = {"explicit": [], "implicit": []}
    for a in range(1, 9):
        prompt = [{"role": "user", "content": f"{a}+{a}="}]
        forms["explicit"].append({"messages": prompt, "chosen": str(2 * a), "rejected": [
            {"role": "assistant", "content": str(2 * a + 1)}]})
        forms["implicit"].append({"chosen": [*prompt, {"role": "assistant", "content": str(2 * a)}],
                                  "rejected": [*prompt, {"role": "assistant", "content": str(2 * a + 1)}]})
    for name, rows in forms.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        cfg = load_config(RewardTrainConfig, None, [f"model.path={tmp_path / 'base'}", "data.task=null",
                                                    f"data.path={path}", f"output_dir={tmp_path / name}", "steps=2",
                                                    "batch_size=4", "eval_pairs=0", "progress=false", "threads=1"])
        assert run_reward_training(cfg)["loss"] > 0, name


def test_write_task_command_writes_chat_rows_and_names_a_bad_option(tmp_path, capsys):
    assert main(["write-task", "addition_chat", str(tmp_path / "chat.jsonl"), "rows=3", "digits=1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    assert rows == make_task_rows("addition_chat", 3, 0, digits=1)
    assert main(["write-task", "addition_chat", str(tmp_path / "other.jsonl"), "digits=one"]) == 2
    assert "digits=one" in capsys.readouterr().err.replace("\n", "")
    assert main(["write-task", "addition_chat", str(tmp_path / "chat.jsonl")]) == 1  # never overwrites
