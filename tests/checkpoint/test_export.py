"""Export of a checkpoint's policy as a Hugging Face folder, and the `checkpoints` / `export` commands."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import tiny_policy, write_checkpoint, write_unfinished
from cli_helpers import gcore_rl, squeeze
from transformers import AutoModelForCausalLM, AutoTokenizer

from gcore_rl.checkpoint import layout
from gcore_rl.checkpoint.export import export_checkpoint
from gcore_rl.checkpoint.manifest import finalize
from gcore_rl.errors import CheckpointError, ConfigError


def test_export_writes_the_saved_weights_and_the_tokenizer(tmp_path, tiny_dir):
    folder, saved = write_checkpoint(tmp_path / "checkpoints", 5, tiny_dir, seed=3)
    out = export_checkpoint(folder, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    expected = saved.state_dict()
    assert set(model.state_dict()) == set(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
    assert not torch.equal(model.state_dict()["model.embed_tokens.weight"],
                           tiny_policy(seed=0).state_dict()["model.embed_tokens.weight"])  # not the init's weights
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    original = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert tokenizer("12+34=")["input_ids"] == original("12+34=")["input_ids"]
    assert model.generation_config.eos_token_id == original.eos_token_id


def test_export_refuses_a_folder_that_holds_a_model(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 5, tiny_dir)
    with pytest.raises(ConfigError, match="already holds a model"):
        export_checkpoint(folder, tiny_dir)


def test_export_names_weights_that_do_not_fit_the_model_config(tmp_path, tiny_dir):
    unfinished = write_unfinished(tmp_path, 5, tiny_policy(), tiny_dir)
    config_file = unfinished / layout.MODEL_DIR / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_hidden_layers": 3}))
    folder = finalize(unfinished, step=5, config_sha256="", controllers=1, trainer_devices=1, devices=1, frozen=[])
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.[a-z_.]+ .*which the trainer state lacks"):
        export_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoints_command_lists_each_folder_and_why_one_is_unusable(tmp_path, tiny_dir):
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        write_checkpoint(root, step, tiny_dir)
    write_unfinished(root, 6, tiny_policy(), tiny_dir)
    (root / "step-00000004" / "trainer" / "__0_0.distcp").unlink()
    proc = gcore_rl("checkpoints", tmp_path / "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") > 8}
    assert set(rows) == {"2", "4", "6"}  # the header row is drawn with heavy bars (┃)
    assert [cell.strip() for cell in rows["2"].split("│")[4:9]] == ["1", "1", "2", "yes", "yes"]
    assert rows["4"].split("│")[8].strip() == "no"
    assert [cell.strip() for cell in rows["6"].split("│")[4:9]] == ["", "", "", "no", ""]
    assert squeeze(f"'{root / 'step-00000004' / 'trainer' / '__0_0.distcp'}' is missing") in squeeze(proc.stdout)


def test_export_command_writes_a_model_folder(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 5, tiny_dir)
    proc = gcore_rl("export", folder, "exported", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exported" in proc.stdout and proc.stderr == ""
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "exported").iterdir()}
