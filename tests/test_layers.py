"""Imports point down: each top-level part of `gcore_rl` imports only from parts in lower layers.

The layers, bottom to top (docs/architecture.md, "Layers"): a part may import its own package and
anything below it, never a neighbour in its own layer or anything above. A new module that needs
something from above is in the wrong place; move the shared piece down instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gcore_rl"

LAYERS: list[set[str]] = [
    {"errors", "faults"},
    {"configlib", "records", "distributed", "disk", "oom"},
    {"models"},
    {"algos", "placement", "telemetry", "rollout"},
    {"rewards", "checkpoint", "report"},
    {"agents"},
    {"data"},
    {"training"},
    {"costmodel"},
    {"config"},
    {"controller", "sim"},
    {"diffusion"},
    {"runtime"},
    {"cli"},
]


def _layer_of(part: str) -> int:
    matches = [index for index, layer in enumerate(LAYERS) if part in layer]
    assert matches, f"gcore_rl/{part} is in no layer of tests/test_layers.py; add it where it belongs"
    return matches[0]


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gcore_rl."):
            parts.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            parts.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("gcore_rl."))
    return parts


def test_every_import_points_to_a_lower_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        own = _part(path)
        for target in _imported_parts(path) - {own}:
            if _layer_of(target) >= _layer_of(own):
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports gcore_rl.{target} "
                              f"(layer {_layer_of(target)}) from layer {_layer_of(own)}")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker finds both import forms (so a passing layer test means something)."""
    module = tmp_path / "mod.py"
    module.write_text("import gcore_rl.runtime.driver\nfrom gcore_rl.controller.loop import run_controller\n")
    assert _imported_parts(module) == {"runtime", "controller"}
