"""`gcore-rl simulate`: the files it writes and its exit codes."""

from __future__ import annotations

import json

from gcore_rl.cli import EXIT_CONFIG, main

SCENARIO = """
name: cli_small
gpus: 8
controllers: 2
steps: 3
models:
  policy: {preset: Qwen2.5-0.5B}
  judge: {preset: Qwen2.5-0.5B}
workload:
  prompts_per_step: 16
  group_size: 4
  response_tokens: {median: 128, sigma: 0.8, max: 1024}
  judge_output_tokens: {median: 64, sigma: 0.3, max: 256}
  dynamic_sampling: {enabled: true}
placement: {rollout_devices: 2, train_devices: 2}
"""


def test_simulate_writes_its_report(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    out = tmp_path / "out"
    code = main(["simulate", str(scenario), "workload.group_size=8", "--out", str(out), "--steps", "2",
                 "--strategies", "colocate,partial"])
    assert code == 0
    assert (out / "summary.md").read_text(encoding="utf-8").count("| colocate |") == 1
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert [r["strategy"] for r in data["results"]] == ["colocate", "partial"]
    assert len(data["results"][0]["step_records"]) == 2
    assert data["scenario"]["workload"]["group_size"] == 8
    for name in ("gantt-colocate.png", "gantt-partial.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "colocate" in capsys.readouterr().out


def test_bad_scenario_exits_with_the_config_status(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("gpus: 8\nworkload: {group_sise: 4}\n", encoding="utf-8")
    assert main(["simulate", str(scenario), "--out", str(tmp_path / "out")]) == EXIT_CONFIG
    assert "workload.group_sise" in "".join(capsys.readouterr().err.split())
    assert main(["simulate", str(scenario), "--strategies", "colocate,teleport"]) == EXIT_CONFIG
