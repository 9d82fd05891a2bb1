"""Same-shaped tensors of a trainer's state stacked into one checkpoint entry, and the layout that undoes it.

DCP's cost per entry is Python work (planning, a `torch.save` record: ~0.25 ms on a 2-core x86
CPU), not bytes, so a small model's save is dominated by its entry count: the demo model's 39
state-dict tensors (38 parameters and the tied output head) and 76 AdamW moments would be 115 entries
(77 with the two moments of a parameter stacked, the format before this one). A transformer's tensors
come in few shapes (every layer's query projection has the same one), so the checkpoint stacks the
tensors of one dtype, global shape and placement into one entry of shape ``(members, *shape)``: the
demo model's state becomes 12 entries.

A *layout* maps each entry key to its members, ``[[tensor name, slot], ...]`` in stack order (slot:
``"param"`` for a parameter, ``"exp_avg"`` / ``"exp_avg_sq"`` for AdamW's moments). It is JSON,
written beside the tensors (``trainer.json``), so a reader restores every tensor by name without
recomputing the grouping: on another number of devices (DCP reshards each entry), or in one
process for an export.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Member", "Layout", "group", "regroup", "members_by_name", "entry_key"]

Member = tuple[str, str]
"""(tensor name, slot) of one tensor in a stacked entry."""

Layout = dict[str, list[list[str]]]
"""Entry key -> its members, ``[[tensor name, slot], ...]`` in stack order (JSON as written)."""


def _signature(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What tensors stacked together must share: dtype, global shape, and (for a DTensor) mesh and placements."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    return tensor.dtype, tuple(tensor.shape), placements, id(mesh) if mesh is not None else None


def entry_key(tensor: torch.Tensor, taken: set[str]) -> str:
    """A readable entry key for a group whose first member is `tensor`: ``float32_128x64`` (a suffix when taken)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    base = f"{dtype}_{'x'.join(str(size) for size in tensor.shape) or 'scalar'}"
    key, index = base, 1
    while key in taken:
        key, index = f"{base}_{index}", index + 1
    return key


def group(named: dict[Member, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, ...]], Layout]:
    """Group `named` tensors by dtype, global shape and placement, in order of first appearance.

    Returns (entries, layout): entries ``{key: (tensor, ...)}`` (a tuple per entry, which the
    checkpoint's staging stacks into one tensor of shape ``(len(tuple), *shape)``), and the layout
    naming each tuple's members in the same order.
    """
    keys: dict[tuple[Any, ...], str] = {}
    entries: dict[str, list[torch.Tensor]] = {}
    layout: Layout = {}
    for member, tensor in named.items():
        signature = _signature(tensor)
        if signature not in keys:
            keys[signature] = entry_key(tensor, set(entries))
            entries[keys[signature]], layout[keys[signature]] = [], []
        entries[keys[signature]].append(tensor)
        layout[keys[signature]].append(list(member))
    return {key: tuple(tensors) for key, tensors in entries.items()}, layout


def members_by_name(layout: Layout) -> dict[Member, tuple[str, int]]:
    """Where each member of a layout lives: (tensor name, slot) -> (entry key, index in the stack)."""
    return {(name, slot): (key, index) for key, members in layout.items()
            for index, (name, slot) in enumerate(members)}


def regroup(layout: Layout, named: dict[Member, torch.Tensor]) -> tuple[dict[str, tuple[torch.Tensor, ...]], list[str]]:
    """`named` tensors arranged by a saved `layout` (the targets of a load), and what does not fit.

    Returns (entries, problems): entries ``{key: (tensor, ...)}`` in the layout's member order, and
    one line per tensor that the layout lacks, that `named` lacks, or whose shape, dtype or placement
    differs from its stack-mates' (global properties: every rank of a collective load finds the same
    problems), empty when `named` fits.
    """
    saved = members_by_name(layout)
    problems = [f"{name} ({slot}) is not in it" for name, slot in named if (name, slot) not in saved]
    entries: dict[str, tuple[torch.Tensor, ...]] = {}
    for key, members in layout.items():
        tensors = []
        for name, slot in members:
            tensor = named.get((name, slot))
            if tensor is None:
                problems.append(f"{name} ({slot}) is in it, and this model has no such tensor")
            elif tensors and _signature(tensor) != _signature(tensors[0]):
                problems.append(f"{name} ({slot}) has shape {tuple(tensor.shape)} and dtype {tensor.dtype} here, saved "
                                f"beside tensors of shape {tuple(tensors[0].shape)} and dtype {tensors[0].dtype}")
            else:
                tensors.append(tensor)
        if len(tensors) == len(members):
            entries[key] = tuple(tensors)
    return entries, problems
