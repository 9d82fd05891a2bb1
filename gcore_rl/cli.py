"""`gcore-rl` command line: train | sft | rm | init-tiny | init-tiny-diffusion | config-reference | simulate | checkpoints | export | report.

`train` and `sft` read a recipe's top-level ``kind``: ``flow_grpo`` / ``flow_matching`` select the diffusion
policy's job (`gcore_rl.diffusion`); without one, the language-model job.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from gcore_rl.errors import EXIT_PREEMPTED, ConfigError, GcoreError, Preempted, did_you_mean

EXIT_CONFIG = 2
EXIT_RUNTIME = 1


EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "": (("the demo: a tiny random model, its supervised warm start (runs/tiny-sft), GRPO from that",
          "gcore-rl init-tiny runs/tiny-base"),
         ("", "gcore-rl sft recipes/sft_addition.yaml"),
         ("", "gcore-rl train recipes/grpo_addition.yaml"),
         ("placement strategies of a 7B policy and judge on 64 simulated GPUs",
          "gcore-rl simulate scenarios/gpus64_judge.yaml")),
    "train": (("GRPO on 2-digit addition from the warm start runs/tiny-sft", "gcore-rl train recipes/grpo_addition.yaml"),
              ("any key of `gcore-rl config-reference` as key=value",
               "gcore-rl train recipes/grpo_addition.yaml run.steps=20 run.output_dir=runs/short algo.kl_coef=0.01"),
              ("checkpoint every 10 steps; run again to continue from the newest",
               "gcore-rl train recipes/grpo_addition.yaml run.checkpoint_every=10 run.resume=auto"),
              ("a recipe with kind: flow_grpo trains a text-to-image policy",
               "gcore-rl train recipes/flow_grpo_shapes.yaml")),
    "sft": (("supervised warm start of runs/tiny-base on addition, saved to runs/tiny-sft",
             "gcore-rl sft recipes/sft_addition.yaml"),
            ("", "gcore-rl sft recipes/sft_addition.yaml lr=0.002 output_dir=runs/my-sft"),
            ("a recipe with kind: flow_matching warm-starts a text-to-image model",
             "gcore-rl sft recipes/flow_sft_shapes.yaml")),
    "rm": (("a scalar reward model on addition preference pairs, saved to runs/tiny-rm",
            "gcore-rl rm recipes/rm_addition.yaml"),
           ("one that reads images, from the vision policy runs/tiny-vl-sft", "gcore-rl rm recipes/rm_vision_shapes.yaml")),
    "init-tiny": (("", "gcore-rl init-tiny runs/tiny-base"),
                  ("a tiny Qwen2-VL (vision-language) model", "gcore-rl init-tiny runs/tiny-vl arch=qwen2_vl"),
                  ("", "gcore-rl init-tiny runs/tiny-judge-base hidden_size=64 num_layers=6 intermediate_size=256")),
    "init-tiny-diffusion": (("", "gcore-rl init-tiny-diffusion runs/tiny-flow"),
                            ("a FLUX-shaped model in the release layout",
                             "gcore-rl init-tiny-diffusion runs/tiny-flux arch=flux text_encoders=release")),
    "write-task": (("chat-format rows for `data.path` of a recipe",
                    "gcore-rl write-task addition_chat data/chat.jsonl rows=2000 digits=2 reverse=1"),
                   ("questions about pictures (the PNGs are written beside the JSONL)",
                    "gcore-rl write-task shapes_vqa data/shapes.jsonl rows=200")),
    "config-reference": (("", "gcore-rl config-reference"), ("", "gcore-rl config-reference --sft"),
                         ("", "gcore-rl config-reference --flow-grpo")),
    "simulate": (("", "gcore-rl simulate scenarios/gpus64_judge.yaml"),
                 ("", "gcore-rl simulate scenarios/gpus512_multimodal.yaml --strategies colocate,partial --steps 10"),
                 ("dotted overrides of the scenario", "gcore-rl simulate scenarios/gpus8_judge.yaml gpus=16 workload.group_size=16"),
                 ("fit the cost constants to a finished run", "gcore-rl simulate --calibrate runs/grpo-addition")),
    "checkpoints": (("", "gcore-rl checkpoints runs/grpo-addition"),),
    "export": (("", "gcore-rl export runs/grpo-addition/checkpoints/step-00000010 runs/grpo-addition-step10"),),
    "report": (("", "gcore-rl report runs/grpo-addition"),
               ("", "gcore-rl report runs/grpo-addition --out /tmp/grpo-addition.html")),
}
"""Each command's examples (the top level's under ""): (what it does, or "" when the line says it, command line)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown command suggests the nearest ones."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            hint = did_you_mean(str(value), action.choices, str)
            raise argparse.ArgumentError(action, f"{value!r} is not a command{f'; {hint}' if hint else ''} (the "
                                         f"commands: {', '.join(action.choices)}; `gcore-rl --help` says what each does)")
        super()._check_value(action, value)


def _epilog(command: str) -> str:
    """The "examples:" section of `command`'s --help (the top level's for "")."""
    lines = ["examples:"]
    for what, line in EXAMPLES[command]:
        lines.extend([f"  # {what}"] if what else [])
        lines.append(f"  {line}")
    if not command:
        lines.append("`gcore-rl COMMAND --help` shows a command's arguments and examples.")
    return "\n".join(lines)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `gcore-rl` parser and its sub-commands' action (`sub.choices` maps each command to its parser)."""
    parser = _Parser(prog="gcore-rl", description="RL training of language models with parallel controllers.",
                     epilog=_epilog(""), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, epilog=_epilog(name),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    train = command("train", "Run a GRPO job from a YAML recipe.")
    train.add_argument("recipe", help="Path of a YAML recipe (see recipes/).")
    train.add_argument("overrides", nargs="*", help="Dotted overrides, e.g. algo.kl_coef=0.01 run.steps=10.")
    sft = command("sft", "Supervised warm start from a YAML recipe.")
    sft.add_argument("recipe")
    sft.add_argument("overrides", nargs="*")
    rm = command("rm", "Train a scalar reward model on preference pairs (Bradley–Terry) from a YAML recipe.")
    rm.add_argument("recipe")
    rm.add_argument("overrides", nargs="*")
    tiny = command("init-tiny", "Write a tiny random model and character tokenizer (HF format).")
    tiny.add_argument("out_dir")
    tiny.add_argument("overrides", nargs="*", help="TinyModelConfig overrides, e.g. hidden_size=64 num_layers=2.")
    tiny_flow = command("init-tiny-diffusion", "Write a tiny random text-to-image flow model (diffusers layout: "
                        "transformer, scheduler, text encoder, tokenizer).")
    tiny_flow.add_argument("out_dir")
    tiny_flow.add_argument("overrides", nargs="*", help="TinyDiffusionConfig overrides, e.g. arch=flux resolution=16, text_encoders=release (an SD3/FLUX release's layout: its text encoders, tokenizers and a VAE).")
    write_task = command("write-task", "Write a built-in task's rows as a JSONL file (e.g. addition_chat: chat-format rows).")
    write_task.add_argument("task", help="A built-in task (see gcore_rl/data/tasks.py), e.g. addition_chat.")
    write_task.add_argument("out", help="The JSONL file to write (must not exist).")
    write_task.add_argument("options", nargs="*", help="rows=N (default 2000), seed=S (default 0) and integer task "
                                                       "options, e.g. digits=1 reverse=1.")
    ref = command("config-reference", "Print every config key with its type, default and meaning.")
    which = ref.add_mutually_exclusive_group()
    which.add_argument("--sft", action="store_true", help="Describe the SFT config instead of the training job.")
    which.add_argument("--rm", action="store_true", help="Describe the reward-model training config instead of the training job.")
    which.add_argument("--flow-grpo", action="store_true", help="Describe a diffusion policy's Flow-GRPO job (recipes with kind: flow_grpo).")
    which.add_argument("--flow-sft", action="store_true", help="Describe a diffusion policy's flow-matching warm start (kind: flow_matching).")
    sim = command("simulate", "Simulate placement strategies of an RLHF job on a GPU cluster (no GPU needed).")
    sim.add_argument("scenario", nargs="?", help="Path of a scenario YAML (see scenarios/).")
    sim.add_argument("overrides", nargs="*", help="Dotted overrides, e.g. gpus=128 workload.group_size=16.")
    sim.add_argument("--out", default=None, help="Output directory (default: runs/sim/<scenario name>).")
    sim.add_argument("--strategies", default=None, help="Comma-separated subset, e.g. colocate,partial,dynamic.")
    sim.add_argument("--steps", type=int, default=None, help="Steps to simulate (overrides the scenario's).")
    sim.add_argument("--calibrate", metavar="RUN_DIR", default=None, help="Instead of simulating: fit the cost constants to a finished `gcore-rl train` run and print predicted vs measured seconds per phase.")
    sim.add_argument("--hardware", default="cpu", help="--calibrate: hardware preset the run ran on (cpu, A100, H100, H200, H20).")
    sim.add_argument("--constants-out", default=None, help="--calibrate: also write the fitted constants as a scenario `costs:` section to this YAML file.")
    checkpoints = command("checkpoints", "List a run's checkpoints: step, time, size, world sizes, whether they are whole.")
    checkpoints.add_argument("path", help="A run's output directory, or its checkpoint folder (run.checkpoint_dir).")
    export = command("export", "Write a checkpoint's policy as a Hugging Face model folder.")
    export.add_argument("checkpoint", help="A checkpoint folder, e.g. runs/grpo-addition/checkpoints/step-00000020.")
    export.add_argument("out_dir", help="A new directory for the model (config.json, safetensors, tokenizer).")
    export.add_argument("--adapter", action="store_true", help="For a LoRA checkpoint (model.lora.enabled): write the "
                        "adapters alone, as a peft folder naming the base model, instead of the merged model.")
    report = command("report", "Write a run's self-contained HTML report: curves, throughput, per-device timeline, samples, config.")
    report.add_argument("run_dir", help="A training run's output directory (run.output_dir).")
    report.add_argument("--out", default=None, help="The HTML file to write (default: RUN_DIR/report.html).")
    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    from gcore_rl.models.loading import quiet_hf_libraries

    quiet_hf_libraries()
    parser, sub = build_parser()
    args = _parse(parser, sub, sys.argv[1:] if argv is None else list(argv))
    console = Console(stderr=True, soft_wrap=True)
    try:
        return _dispatch(args)
    except GcoreError as raised:
        exc = _user_error(raised)
        if isinstance(exc, ConfigError):
            console.print(f"[bold red]config error:[/] {escape(str(exc))}", highlight=False)  # [..] is text here
            return EXIT_CONFIG
        if isinstance(exc, Preempted):
            console.print(f"[yellow]preempted:[/] {escape(str(exc))}", highlight=False)
            return EXIT_PREEMPTED
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except BrokenPipeError:  # `gcore-rl config-reference | head`: the reader left; say nothing more (before
        # `Exception`, which would re-raise it)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - only a failed allocation is replaced by a paragraph
        from gcore_rl.oom import driver_out_of_memory

        message = driver_out_of_memory(exc, args.command)
        if message is None:
            raise
        console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
        return EXIT_RUNTIME


def _user_error(exc: GcoreError) -> GcoreError:
    """The error to show for `exc`: the user-facing error of a Ray actor rather than the runtime's wrapper.

    The Ray runtime re-raises a failed actor task as a GcoreError carrying the remote traceback;
    its context, a `ray.exceptions.RayTaskError`, keeps the actor's own exception as `cause`. When
    that is a GcoreError (a bad row, a damaged model) it is the one paragraph to show, with its
    own exit status.
    """
    cause = getattr(exc.__context__, "cause", None)
    return cause if isinstance(cause, GcoreError) else exc


def _parse(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, letting options stand between a command's positionals (``simulate S --out D gpus=8``).

    Plain parsing ends a run of positionals at the first option and leaves later ones over; the
    command's own parser then takes them with `parse_intermixed_args` (which cannot parse the top
    level's sub-commands, hence the second stage). Usage errors exit with 2.
    """
    args, left_over = parser.parse_known_args(argv)
    if not left_over:
        return args
    intermixed = sub.choices[args.command].parse_intermixed_args(argv[argv.index(args.command) + 1:])
    intermixed.command = args.command
    return intermixed


def _write_task(task: str, out: str, options: list[str]) -> int:
    """`gcore-rl write-task TASK OUT [rows=N] [seed=S] [option=V ...]`: a built-in task's rows as JSONL."""
    from gcore_rl.data.tasks import write_task_jsonl

    values: dict[str, int] = {}
    for item in options:
        key, sep, text = item.partition("=")
        if not sep or not key or not text.lstrip("-").isdigit():
            raise ConfigError(key or item, f"write-task takes integer options as key=value, got {item!r}")
        values[key] = int(text)
    rows, seed = values.pop("rows", 2000), values.pop("seed", 0)
    path = write_task_jsonl(task, out, rows, seed, **values)
    print(f"{rows} rows of task {task} written to {path}")
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    from gcore_rl.configlib import describe, load_config

    if args.command == "train" and _recipe_kind(args.recipe) == "flow_grpo":
        return _train_flow_grpo(args)
    if args.command == "sft" and _recipe_kind(args.recipe) == "flow_matching":
        return _flow_sft(args)
    if args.command == "train":
        from gcore_rl.config import load_job_config
        from gcore_rl.runtime.driver import run_job

        cfg = load_job_config(args.recipe, args.overrides)
        summary = run_job(cfg, on_ready=lambda ready: print(where_outputs_go(ready.run), flush=True))
        print(f"done: {summary.steps} steps in {summary.wall_seconds:.1f}s; reward {summary.first_reward:.3f} → "
              f"{summary.last_reward:.3f}; eval accuracy {_fmt(summary.eval_accuracy_before)} → "
              f"{_fmt(summary.eval_accuracy_after)}; outputs in {summary.output_dir}")
        _say_report(summary.output_dir)
        return 0
    if args.command == "sft":
        from gcore_rl.training.sft import load_sft_config, run_sft

        cfg = load_sft_config(args.recipe, args.overrides)
        result = run_sft(cfg)
        held_out = (f"; held-out accuracy {_fmt(result.eval_accuracy_before)} → {_fmt(result.eval_accuracy)}"
                    if result.eval_accuracy is not None else "")
        target = f" (target {cfg.target_accuracy} reached)" if result.target_reached else ""
        print(f"sft done: {result.steps} steps in {result.wall_seconds:.1f}s; final loss {result.loss:.4f}"
              f"{held_out}{target}; model in {cfg.output_dir}")
        return 0
    if args.command == "rm":
        from gcore_rl.training.reward_trainer import RewardTrainConfig, run_reward_training

        cfg = load_config(RewardTrainConfig, args.recipe, args.overrides)
        result = run_reward_training(cfg)
        accuracy = (f"; held-out pair accuracy {_fmt(result.get('eval_accuracy_before'))} → {_fmt(result.get('eval/accuracy'))}"
                    if "eval/accuracy" in result else "")
        best = f" (the weights of step {result['best_step']})" if "best_step" in result else ""
        print(f"rm done: {result['steps']} steps, final loss {result['loss']:.4f}, pair accuracy "
              f"{result['accuracy']:.3f}{accuracy}{best} in {result['wall_seconds']:.1f}s; model in {cfg.output_dir}")
        return 0
    if args.command == "init-tiny":
        from gcore_rl.configlib import apply_overrides, from_dict
        from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

        tiny_cfg = from_dict(TinyModelConfig, apply_overrides({}, args.overrides))
        if (Path(args.out_dir) / "config.json").exists():
            raise ConfigError("DIR", f"'{args.out_dir}' already holds a model (config.json); choose a new "
                              "directory or remove the old one, so a trained model is never overwritten")
        path = write_tiny_model(args.out_dir, tiny_cfg)
        print(f"tiny model written to {path}")
        return 0
    if args.command == "init-tiny-diffusion":
        return _init_tiny_diffusion(args)
    if args.command == "write-task":
        return _write_task(args.task, args.out, args.options)
    if args.command == "config-reference":
        from gcore_rl.config import JobConfig
        from gcore_rl.training.reward_trainer import RewardTrainConfig
        from gcore_rl.training.sft import SftConfig

        if args.flow_grpo or args.flow_sft:
            from gcore_rl.diffusion.config import FlowGrpoJobConfig
            from gcore_rl.training.flow_sft import FlowSftConfig

            print(describe(FlowGrpoJobConfig if args.flow_grpo else FlowSftConfig))
            return 0
        print(describe(SftConfig if args.sft else RewardTrainConfig if args.rm else JobConfig))
        return 0
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "checkpoints":
        return _checkpoints(Path(args.path))
    if args.command == "report":
        from gcore_rl.report.run_report import write_run_report

        print(f"report: {write_run_report(args.run_dir, args.out)}")
        return 0
    if args.command == "export":
        from gcore_rl.checkpoint.adapters import export_lora_checkpoint, saved_lora
        from gcore_rl.checkpoint.export import export_checkpoint, is_diffusion_checkpoint
        from gcore_rl.diffusion.checkpointing import export_flow_checkpoint

        if is_diffusion_checkpoint(args.checkpoint):
            out = export_flow_checkpoint(args.checkpoint, args.out_dir, adapter=args.adapter)
        elif args.adapter or saved_lora(args.checkpoint) is not None:
            out = export_lora_checkpoint(args.checkpoint, args.out_dir, adapter=args.adapter)
        else:
            out = export_checkpoint(args.checkpoint, args.out_dir)
        print(f"exported {args.checkpoint} to {out}")
        return 0
    raise AssertionError(args.command)


def where_outputs_go(run: Any, flow: bool = False) -> str:
    """What `train` prints before its job starts: where the outputs go, from the job's `run` section (a language
    job's `RunConfig`, or with `flow` a diffusion job's `FlowRunConfig`, whose runs write sample grids instead of
    the HTML report)."""
    from gcore_rl.checkpoint.layout import checkpoint_root
    from gcore_rl.report.run_report import report_path
    from gcore_rl.telemetry.loggers import logger_location
    from gcore_rl.telemetry.metrics import METRICS_FILENAME

    out = Path(run.output_dir)
    metrics = ", ".join([str(out / METRICS_FILENAME),
                         *(f"{name}: {logger_location(name, out)}" for name in run.loggers if name != "jsonl")])
    if flow:
        shown = ("sample grids", f"{out / 'grid_before.png'}, {out / 'grid_after.png'}")
    else:
        when = f"{_every(run.report_every)} and at the end" if run.report_every else "at the end"
        shown = ("report", f"{report_path(out)} ({when}; `gcore-rl report {out}` draws it any time)")
    root = checkpoint_root(run.output_dir, run.checkpoint_dir)
    saved = (f"{root}, {_every(run.checkpoint_every)} (the newest {run.keep_checkpoints} kept)"
             if run.checkpoint_every else "off (run.checkpoint_every=0)")
    rows = [("run folder", str(out)), ("metrics", metrics), shown, ("checkpoints", saved),
            ("final model", str(out / "final") if run.save_final else "not saved (run.save_final=false)")]
    return "\n".join(["outputs of this run:", *(f"  {name:<13}{value}" for name, value in rows)])


def _every(steps: int) -> str:
    return "every step" if steps == 1 else f"every {steps} steps"


def _say_report(run_dir: str) -> None:
    """Print where a finished run's HTML report is, when it was written."""
    from gcore_rl.report.run_report import report_path

    if report_path(run_dir).is_file():
        print(f"report: {report_path(run_dir)}")


def _recipe_kind(recipe: str) -> str | None:
    """The recipe's top-level ``kind`` (``flow_grpo``, ``flow_matching``), or None: a language-model recipe,
    or a file that does not parse (whose loading then reports what is wrong)."""
    import yaml

    try:
        data = yaml.safe_load(Path(recipe).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def _train_flow_grpo(args: argparse.Namespace) -> int:
    from gcore_rl.configlib import load_config
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.runtime.driver import run_job

    cfg = load_config(FlowGrpoJobConfig, args.recipe, args.overrides)
    summary = run_job(cfg, on_ready=lambda ready: print(where_outputs_go(ready.run, flow=True), flush=True))
    print(f"done: {summary.steps} steps in {summary.wall_seconds:.1f}s; reward (mean of the first / last 10 steps) "
          f"{summary.first_rewards:.3f} → {summary.last_rewards:.3f}; held-out reward {summary.eval_reward_before:.3f} → "
          f"{summary.eval_reward_after:.3f}; sample grids grid_before.png, grid_after.png in {summary.output_dir}")
    _say_report(summary.output_dir)
    return 0


def _flow_sft(args: argparse.Namespace) -> int:
    from gcore_rl.configlib import load_config
    from gcore_rl.training.flow_sft import FlowSftConfig, run_flow_sft

    cfg = load_config(FlowSftConfig, args.recipe, args.overrides)
    result = run_flow_sft(cfg)
    print(f"sft done: {result.steps} steps in {result.wall_seconds:.1f}s; held-out flow-matching loss "
          f"{result.held_out_loss:.4f}{f' (target {cfg.target_loss} reached)' if result.target_reached else ''}; "
          f"model and samples.png in {cfg.output_dir}")
    if cfg.target_loss > 0 and not result.target_reached:
        raise GcoreError(f"the held-out loss {result.held_out_loss:.4f} did not reach target_loss={cfg.target_loss} in "
                         f"max_steps={cfg.max_steps} steps; the model in {cfg.output_dir} is a weaker start than the "
                         "recipe asks for (raise max_steps, or lower the target)")
    return 0


def _init_tiny_diffusion(args: argparse.Namespace) -> int:
    from gcore_rl.configlib import apply_overrides, from_dict
    from gcore_rl.models.flow import TinyDiffusionConfig, write_tiny_diffusion

    cfg = from_dict(TinyDiffusionConfig, apply_overrides({}, args.overrides))
    if (Path(args.out_dir) / "transformer").exists() or (Path(args.out_dir) / "config.json").exists():
        raise ConfigError("DIR", f"'{args.out_dir}' already holds a model; choose a new directory or remove the old one, "
                          "so a trained model is never overwritten")
    layout = " in the release layout (several text encoders, a VAE)" if cfg.text_encoders == "release" else ""
    print(f"tiny {cfg.arch} flow model{layout} written to {write_tiny_diffusion(args.out_dir, cfg)}")
    return 0


def _checkpoints(path: Path) -> int:
    """Print the checkpoints under a run or checkpoint folder as a table, then why any finished one is unusable."""
    from rich.table import Table

    from gcore_rl.checkpoint.manifest import list_checkpoints, resolve_root, verify
    from gcore_rl.errors import CheckpointError

    root = resolve_root(path)
    if not root.is_dir():
        raise CheckpointError(f"'{path}' does not exist or is not a folder; give a run's output directory or "
                              "its checkpoint folder (run.checkpoint_dir)")
    infos = list_checkpoints(root)
    if not infos:
        print(f"no checkpoints in {root}")
        return 0
    table = Table(title=f"checkpoints in {root}")
    for column in ("step", "created", "size", "controllers", "trainer devices", "devices", "complete", "verified"):
        table.add_column(column, justify="right" if column in ("step", "size") else "left")
    problems = []
    for info in infos:
        verified = ""
        if info.complete:
            try:
                verify(info.path, checksums=False)
                verified = "yes"
            except CheckpointError as exc:
                verified = "no"
                problems.append(str(exc))
        table.add_row(str(info.step), info.created or "", _size(info.bytes), *(_fmt_count(count) for count in (
            info.controllers, info.trainer_devices, info.devices)), "yes" if info.complete else "no", verified)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a file or pipe: do not squeeze the table into 80 columns
    console.print(table)
    for problem in problems:
        print(problem)
    return 0


def _size(count: int) -> str:
    """A byte count in B, KiB, MiB or GiB (one decimal)."""
    if count < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _fmt_count(value: int | None) -> str:
    return "" if value is None else str(value)


def _simulate(args: argparse.Namespace) -> int:
    if args.calibrate:
        ignored = [name for name, value in (("SCENARIO", args.scenario), ("overrides", args.overrides), ("--out", args.out),
                                            ("--strategies", args.strategies), ("--steps", args.steps)) if value]
        if ignored:
            raise ConfigError("--calibrate", f"reads a run directory, not a scenario; drop {', '.join(ignored)}")
        return _calibrate(args)
    if args.constants_out or args.hardware != "cpu":
        raise ConfigError("--hardware" if args.hardware != "cpu" else "--constants-out",
                          "only applies with --calibrate RUN_DIR (a scenario sets its hardware under `hardware:`)")
    if not args.scenario:
        raise ConfigError("scenario", "give a scenario YAML (e.g. scenarios/gpus64_judge.yaml) or --calibrate RUN_DIR")
    from gcore_rl.sim.report import rich_table, write_report
    from gcore_rl.sim.scenario import load_scenario
    from gcore_rl.sim.simulator import run_scenario

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.strategies:
        names = [name.strip() for name in args.strategies.split(",") if name.strip()]
        overrides.append("strategies=[" + ", ".join(names) + "]")
    scenario = load_scenario(args.scenario, overrides)
    results = run_scenario(scenario)
    out = args.out or f"runs/sim/{scenario.name}"
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a file or pipe: do not squeeze the table into 80 columns
    console.print(rich_table(results, title=f"{scenario.name}: mean seconds per step"))
    written = write_report(results, out, scenario)
    print(f"wrote {', '.join(sorted(p.name for p in written.values()))} to {out}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from gcore_rl.sim.calibrate import balance_table, calibrate, read_run, resolve_hardware

    run = read_run(args.calibrate)
    result = calibrate(run, resolve_hardware(args.hardware))
    print(f"calibration of {args.calibrate} on {result.hardware.name} (median seconds per device and step; "
          "held out: fitted on odd steps, compared on even steps)")
    print(result.table())
    if (split := balance_table(run)) is not None:
        print("the update is priced at its slowest trainer rank (work per device x train/cost_imbalance):")
        print(split)
    print(result.constants_yaml(), end="")
    if args.constants_out:
        Path(args.constants_out).write_text(result.constants_yaml())
        print(f"wrote {args.constants_out}")
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
