"""MkDocs hooks: pages generated from the code and from the repository root at build time.

- `config-reference.md`: every config key with its type, default and help, rendered from the same
  dataclasses and the same `gcore_rl.configlib.describe` walk as `gcore-rl config-reference`, so the
  page cannot drift from the code.
- `benchmarks.md`: the repository's BENCHMARKS.md, its links rewritten for the site (paths under
  `docs/` become site paths; other repository files become inline code, since the site holds no
  source files).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]

# (heading, command, the root dataclass) of each config reference section
CONFIGS = (
    ("GRPO / PPO jobs", "gcore-rl config-reference", "gcore_rl.config:JobConfig"),
    ("Supervised warm start (`gcore-rl sft`)", "gcore-rl config-reference --sft", "gcore_rl.training.sft:SftConfig"),
    ("Reward-model training (`gcore-rl rm`)", "gcore-rl config-reference --rm",
     "gcore_rl.training.reward_trainer:RewardTrainConfig"),
    ("Flow-GRPO jobs (diffusion policies)", "gcore-rl config-reference --flow-grpo",
     "gcore_rl.diffusion.config:FlowGrpoJobConfig"),
    ("Flow-matching warm start", "gcore-rl config-reference --flow-sft", "gcore_rl.training.flow_sft:FlowSftConfig"),
    ("Simulator scenarios (`gcore-rl simulate`)", "", "gcore_rl.sim.scenario:Scenario"),
)
_HEAD = re.compile(r"^(?P<key>[\w.\[\]<>-]+)(?:  \[section (?P<section>\w+)\]|: (?P<type>.*) = (?P<default>.*))$")


def describe_markdown(text: str) -> str:
    """`configlib.describe`'s plain text as Markdown: a table per top-level section, a row per key."""
    out: list[str] = []
    key = kind = None
    help_lines: list[str] = []

    def flush() -> None:
        if key is not None and kind is not None:
            meaning = " ".join(help_lines).replace("|", "\\|")
            out.append(f"| `{key}` | <code>{kind}</code> | {meaning} |")

    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("    "):
            help_lines.append(line.strip())
            continue
        m = _HEAD.match(line)
        if m is None:
            raise ValueError(f"unexpected line in the config reference: {line!r}")
        flush()
        key, help_lines = m["key"], []
        if m["section"]:
            kind = None
            if "." not in key:
                out += ["", f"### `{key}`", "", "| key | type = default | meaning |", "|---|---|---|"]
            continue
        kind = html.escape(f"{m['type']} = {m['default']}").replace("|", "&#124;")  # a cell's pipes end it
        if not out:  # top-level keys before any section
            out += ["", "| key | type = default | meaning |", "|---|---|---|"]
    flush()
    return "\n".join(out)


def config_reference() -> str:
    from gcore_rl.configlib import describe, load_callable

    parts = ["# Config reference", "",
             "Every key a recipe or a `key=value` override may set, generated from the config dataclasses when",
             "the site is built (the same text as `gcore-rl config-reference`). Dotted keys are what the command",
             "line takes: `gcore-rl train RECIPE run.steps=20 sampling.n=4`."]
    for heading, command, target in CONFIGS:
        cls = load_callable(target, "docs")
        parts += ["", f"## {heading}", ""]
        if command:
            parts += [f"`{command}` prints the same.", ""]
        parts.append(describe_markdown(describe(cls)))
    return "\n".join(parts) + "\n"


def benchmarks_page() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)

    # a link to another repository file (not a page or picture of the site) keeps its text and shows the path
    return re.sub(r"\[([^\]]+)\]\(((?!https?:|#|figures/|images/)[^)]+)\)",
                  lambda m: m[1] if m[2] in m[1] else f"{m[1]} (`{m[2]}`)", text)


def on_files(files, config):
    files.append(File.generated(config, "config-reference.md", content=config_reference()))
    files.append(File.generated(config, "benchmarks.md", content=benchmarks_page()))
    return files
