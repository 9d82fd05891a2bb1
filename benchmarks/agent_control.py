"""The tool-use demo's control: a `mul` tool that never answers (every call is an error given back to the model).

    .venv/bin/python benchmarks/demo_seeds.py --demo agent --seeds 0 --threads 1 --control

runs `recipes/grpo_agent_mul.yaml` with this tool in place of the real one (the same name and schema, so the
prompts and the warm start's calls are unchanged): held-out accuracy can then rise only by multiplying without
the tool, which the tiny model cannot.
"""

from __future__ import annotations


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    raise RuntimeError("the tool is unavailable")
