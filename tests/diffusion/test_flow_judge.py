"""A vision-language judge scores a diffusion policy's samples: it sees each image in place of {completion},
its verdict's reward joins the rule rewards, and a text-only judge is refused before any step."""

import json

from cli_helpers import REPO, assert_user_error, gcore_rl

FLOW_RUN = ["run.steps=2", "run.eval_every=2", "run.prompts_per_step=2", "sampling.n=2", "sampling.resolution=8",
            "run.progress=false"]


def test_a_vision_language_judge_scores_the_images(tmp_path, flow_dirs):
    made = gcore_rl("init-tiny", "judge", "arch=qwen2_vl", "hidden_size=32", "num_layers=1", "intermediate_size=64",
                    "vision.image_size=16", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    proc = gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", f"model.path={flow_dirs['sd3']}", "run.output_dir=grpo",
                    "judge.enabled=true", "judge.model_path=judge", "judge.template=a picture of {prompt}: {completion} score:",
                    "judge.weight=0.5", *FLOW_RUN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if line["step"] > 0]
    assert len(trained) == 2
    # a random judge's verdicts rarely parse: each reward is in [0, 1], so their mean is too; the scores go under the
    # judge's own name, as a language job's (its unparsed verdicts counted)
    assert all(0.0 <= line["judge/mean_score"] <= 1.0 and 0 <= line["judge/unparsed"] <= 4 for line in trained)


def test_a_text_only_judge_is_refused_for_images(tmp_path, flow_dirs):
    made = gcore_rl("init-tiny", "judge", "hidden_size=32", "num_layers=1", "intermediate_size=64", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    proc = gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", f"model.path={flow_dirs['sd3']}", "run.output_dir=grpo",
                    "judge.enabled=true", "judge.model_path=judge", *FLOW_RUN, cwd=tmp_path)
    assert_user_error(proc, 2, "judge.model_path", "text-only model")
