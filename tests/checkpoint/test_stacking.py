"""Same-shaped tensors stacked into one checkpoint entry, and restored by name from the saved layout."""

from __future__ import annotations

import json

import torch
from checkpoint_helpers import tiny_policy

from gcore_rl.checkpoint import stacking


def _named(model: torch.nn.Module) -> dict[stacking.Member, torch.Tensor]:
    return {(name, "param"): tensor for name, tensor in model.state_dict().items()}


def test_a_transformer_state_becomes_one_entry_per_distinct_shape():
    named = _named(tiny_policy())
    entries, layout = stacking.group(named)
    distinct = {(tensor.dtype, tuple(tensor.shape)) for tensor in named.values()}
    assert len(entries) == len(distinct) < len(named) / 3
    assert json.loads(json.dumps(layout)) == layout  # written as JSON beside the tensors
    where = stacking.members_by_name(layout)
    assert set(where) == set(named)
    for member, tensor in named.items():
        key, index = where[member]
        assert entries[key][index] is tensor
        assert key == stacking.entry_key(tensor, set()) or key.startswith(stacking.entry_key(tensor, set()) + "_")


def test_tensors_of_one_shape_and_another_dtype_are_kept_apart():
    named = {("a", "param"): torch.zeros(4, 3), ("b", "param"): torch.zeros(4, 3, dtype=torch.bfloat16),
             ("a", "exp_avg"): torch.zeros(4, 3)}
    entries, layout = stacking.group(named)
    assert layout == {"float32_4x3": [["a", "param"], ["a", "exp_avg"]], "bfloat16_4x3": [["b", "param"]]}
    assert [len(parts) for parts in entries.values()] == [2, 1]


def test_regroup_follows_the_saved_layout_and_names_what_does_not_fit():
    model = tiny_policy()
    named = _named(model)
    _, layout = stacking.group(named)
    reordered = dict(reversed(list(named.items())))  # another process may list its tensors in another order
    entries, problems = stacking.regroup(layout, reordered)
    assert problems == []
    assert {key: [id(t) for t in parts] for key, parts in entries.items()} == \
           {key: [id(named[tuple(member)]) for member in members] for key, members in layout.items()}

    stack = next(members for members in layout.values() if len(members) > 1)
    second = tuple(stack[1])  # its stack's first member stays, so the two shapes are compared
    gone = next(member for member in named if list(member) not in stack)
    changed = {**named, second: torch.zeros(3, 3), ("extra.weight", "param"): torch.zeros(2)}
    del changed[gone]
    _, problems = stacking.regroup(layout, changed)
    assert sorted(problems) == sorted([
        "extra.weight (param) is not in it",
        f"{gone[0]} (param) is in it, and this model has no such tensor",
        f"{second[0]} (param) has shape (3, 3) and dtype torch.float32 here, saved beside tensors of shape "
        f"{tuple(named[second].shape)} and dtype torch.float32"])
