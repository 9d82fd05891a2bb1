"""A LoRA job through the real command line, its trainer offloaded while the engine generates and its engine
sent the adapters alone: it trains the adapters with the base as the KL's reference, its checkpoints hold the adapters alone and resume to the same record after a SIGKILL (slow), and `gcore-rl
export` writes a merged model that `transformers` loads and an adapter folder that `peft` loads onto the base.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import test_resume
import torch
from cli_helpers import NO_STOP, RECIPE, SHORT, gcore_rl
from test_resume import records

from gcore_rl.checkpoint.layout import step_dir
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.sync=adapters",
        "train.lr=0.01"]
workdir = test_resume.workdir  # the fixture: the tiny model and the digits reward
JOB = ["run.steps=2", "run.checkpoint_every=2", "data.eval_prompts=0", NO_STOP, *SHORT, "algo.kl_coef=0.05",
       "train.mini_batches=2", "reward.rules.0.fn=digits:fraction", "train.offload=all", *LORA]


def train(workdir: Path, out: Path, *extra: str, fault: str | None = None):
    return gcore_rl("train", RECIPE, "model.path=tiny", f"run.output_dir={out}", *JOB, *extra, cwd=workdir,
                    extra_pythonpath=workdir, fault=fault)


def _dir_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    out = workdir / "uninterrupted"
    proc = train(workdir, out)
    assert proc.returncode == 0, proc.stderr
    return out


def test_a_lora_run_trains_the_adapters_from_the_base(workdir, uninterrupted):
    metrics, _ = records(uninterrupted)
    assert [m["step"] for m in metrics] == [1, 2]
    # step 1 samples the base, which is also the reference (adapters off): only its second mini-batch, after
    # one optimiser step, sees a policy away from it
    assert 0.0 < metrics[0]["kl"] < min(1e-4, metrics[-1]["kl"]) and len({m["pg_loss"] for m in metrics}) > 1
    assert all(m["rollout/logprob_gap_max"] < 1e-4 for m in metrics)  # the engine applies the adapters it is sent
    # the trainer's state left the device for every rollout (here a CPU: the same memory, so nothing is freed)
    assert all(m["work/swap/trainer_offloaded_bytes"] > 0 for m in metrics)
    # the device's peak resident memory of each phase (what benchmarks/memory.py tabulates)
    raw = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert all(m["memory/rss_peak_mib/update_train_max"] > 0 and m["memory/rss_peak_mib/rollout_generate_max"] > 0
               for m in raw)
    saved = step_dir(uninterrupted / "checkpoints", 2)
    manifest = json.loads((saved / "manifest.json").read_text())
    assert {frozen["role"] for frozen in manifest["frozen"]} >= {"base"}
    base_bytes = sum(f.stat().st_size for f in (workdir / "tiny").glob("*.safetensors"))
    assert all(0 < m["work/sync/bytes"] < 0.5 * base_bytes for m in metrics)  # the adapters alone
    # the adapters and their two AdamW moments, against the weights and two moments a full fine-tune saves
    # (rank 4 on this 32-wide model's linear layers: a quarter of their parameters; the embedding not at all)
    assert _dir_bytes(saved / "trainer") < 0.35 * 3 * base_bytes


def test_exports_load_with_transformers_and_peft(workdir, uninterrupted, tmp_path):
    from peft import PeftModel

    saved = step_dir(uninterrupted / "checkpoints", 2)
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    for out, extra in ((merged_dir, ()), (adapter_dir, ("--adapter",))):
        proc = gcore_rl("export", saved, out, *extra, cwd=workdir)
        assert proc.returncode == 0, proc.stderr
    merged = load_causal_lm(merged_dir).eval()
    adapted = PeftModel.from_pretrained(load_causal_lm(workdir / "tiny"), adapter_dir).eval()
    final = load_causal_lm(uninterrupted / "final").eval()
    base = load_causal_lm(workdir / "tiny").eval()
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11]])
    with torch.no_grad():
        expected = merged(ids).logits
        assert float((adapted(ids).logits - expected).abs().max()) < 1e-5
        assert float((final(ids).logits - expected).abs().max()) < 1e-5  # the run's own final model: step 2
        assert float((base(ids).logits - expected).abs().max()) > 1e-4  # the adapters moved the policy
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4


def test_export_refuses_a_base_that_changed(workdir, uninterrupted, tmp_path):
    """The adapters only mean something on the base they were trained on: export checks its checksum (here the
    manifest of a copied checkpoint is pointed at a copy of the base, which is then replaced)."""
    saved = Path(shutil.copytree(step_dir(uninterrupted / "checkpoints", 2), tmp_path / "checkpoints" / "step-00000002"))
    base = Path(shutil.copytree(workdir / "tiny", tmp_path / "base"))
    manifest = json.loads((saved / "manifest.json").read_text())
    for frozen in manifest["frozen"]:
        frozen["path"] = str(base) if frozen["role"] == "base" else frozen["path"]
    (saved / "manifest.json").write_text(json.dumps(manifest))
    proc = gcore_rl("export", saved, tmp_path / "merged", cwd=workdir)
    assert proc.returncode == 0, proc.stderr  # the copy is the base the checkpoint was trained on
    write_tiny_model(base, TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=99))
    proc = gcore_rl("export", saved, tmp_path / "out", cwd=workdir)
    assert proc.returncode == 1, proc.stderr
    assert "other weights than when it was saved" in " ".join(proc.stderr.split())
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_killed_lora_run_resumes_to_the_same_record(workdir):
    whole, out = workdir / "whole-4", workdir / "killed"
    assert train(workdir, whole, "run.steps=4").returncode == 0
    killed = train(workdir, out, "run.steps=4", fault="train:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = train(workdir, out, "run.steps=4", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing from '{step_dir(out / 'checkpoints', 2).resolve()}'" in resumed.stdout, resumed.stdout
    assert records(out) == records(whole)
