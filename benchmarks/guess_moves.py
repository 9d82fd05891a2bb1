"""How a GuessTheNumber policy plays, step by step, read from a run's `samples.jsonl` (`run.samples_per_step` set
to the step's trajectory count logs every episode): the mean reward, the share of wins, and the share of guesses
after the first that the game's answers so far allow (a policy that reads the hints: 1.0; one that ignores them:
about 0.4 on numbers 1..16).

    .venv/bin/python benchmarks/guess_moves.py runs/grpo-textarena-guess [more runs]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gcore_rl.agents.players import hint_range  # noqa: E402

_MOVE = re.compile(r"\[(\d+)\]")


def episode(sample: dict) -> list[dict[str, str]]:
    """The sample's conversation in `players` form: the opening (its range), then moves and the game's answers."""
    opening = sample["prompt"]
    turns = sample.get("turns") or [{"text": sample["completion"], "inserted": False}]
    messages = [{"role": "user", "content": opening}]
    for turn in turns:
        messages.append({"role": "user" if turn["inserted"] else "assistant", "content": turn["text"]})
    return messages


def within_hints(messages: list[dict[str, str]]) -> tuple[int, int]:
    """(guesses after the first that the answers before them allow, guesses after the first)."""
    allowed = total = 0
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant" or i == 1:
            continue
        move = _MOVE.search(turn["content"])
        low, high = hint_range(messages[:i])
        total += 1
        allowed += bool(move) and low <= int(move.group(1)) <= high
    return allowed, total


def summarise(run: Path) -> list[dict[str, float]]:
    """Per step: mean reward, share of wins, share of later guesses within the hints, trajectories."""
    steps: dict[int, list[dict]] = defaultdict(list)
    for line in (run / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        steps[sample["step"]].append(sample)
    rows = []
    for step, samples in sorted(steps.items()):
        counts = [within_hints(episode(s)) for s in samples]
        allowed, total = sum(a for a, _ in counts), sum(t for _, t in counts)
        rows.append({"step": step, "reward": sum(s["reward"] for s in samples) / len(samples),
                     "wins": sum(s["reward"] >= 1.0 for s in samples) / len(samples),
                     "within_hints": allowed / max(total, 1), "trajectories": len(samples)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    for run in args.runs:
        print(f"{run}:")
        for row in summarise(run):
            print(f"  step {row['step']:3d}  reward {row['reward']:.3f}  wins {row['wins']:.2f}  "
                  f"within hints {row['within_hints']:.2f}  ({row['trajectories']} trajectories)")


if __name__ == "__main__":
    main()
