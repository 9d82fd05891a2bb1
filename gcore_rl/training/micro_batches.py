"""Which rows of a batch go into each forward (and backward) pass of the trainer.

Without a token budget a pass takes `rows` consecutive rows, as it always has. With one
(`train.max_tokens_per_micro_batch`), passes are filled by token count, so a batch with a long
tail of lengths is not cut into passes as large as its longest rows allow nor as small as its
count cap forces: first-fit decreasing bin packing (rows longest first, each into the first pass
it fits), which never uses more than 11/9 · OPT + 6/9 passes (Dósa 2007, "The tight bound of first
fit decreasing bin-packing algorithm is FFD(I) ≤ 11/9 OPT(I) + 6/9"). A pass's tokens are what its
forward computes: the sum of the lengths when packed (`training/packing.py`), rows × the longest
row when padded.

FSDP's collectives run in every pass, so the ranks move through their passes in lockstep: a step costs
the sum over passes of the slowest rank's pass, not the slowest rank's sum. Budget passes therefore run
heaviest first on every rank, so the ranks' p-th passes are alike in size (a cost-balanced split,
`data/balance.py`, gives each rank a similar spread of lengths); in arrival order a rank's long pass
could meet another's short one and each would wait for the other in turn. (A rank that splits passes to
match the group's count, below, keeps each pass's halves where the pass was, so its order is then
heaviest first only up to those halves.)

Every trainer rank must also run the same number of passes:
`MicroBatching.passes` agrees on the largest count over the group, ranks with fewer split their
largest passes, and a rank left with fewer passes than that (fewer rows than passes) runs dummy
passes (None) that the callers weight by zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcore_rl.records import TokenBatch
from gcore_rl.training.shapes import mini_batch_slices


def plan_passes(lengths: Sequence[int], rows: int, max_tokens: int, packed: bool) -> list[list[int]]:
    """Row indices of each pass (each list ascending).

    `lengths` are the rows' real token counts. `max_tokens` 0: consecutive runs of `rows` rows, in
    order. Otherwise first-fit decreasing with at most `rows` rows and `max_tokens` tokens per pass,
    the passes heaviest first (by the tokens their forward computes; ties by their first row);
    ValueError naming the row when one row alone exceeds the budget.
    """
    if max_tokens <= 0:
        return [list(range(start, min(start + rows, len(lengths)))) for start in range(0, len(lengths), rows)]
    passes: list[list[int]] = []
    tokens: list[int] = []  # per pass: Σ lengths (packed) or its longest row (padded: rows sorted longest first)
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        length = int(lengths[row])
        if length > max_tokens:
            raise ValueError(f"row {row} has {length} tokens, more than train.max_tokens_per_micro_batch="
                             f"{max_tokens} allows in one pass; raise the budget to at least the longest "
                             "prompt + sampling.max_new_tokens")
        for index, members in enumerate(passes):
            cost = tokens[index] + length if packed else tokens[index] * (len(members) + 1)
            if len(members) < rows and cost <= max_tokens:
                members.append(row)
                if packed:
                    tokens[index] = cost
                break
        else:
            passes.append([row])
            tokens.append(length)
    order = sorted(range(len(passes)), key=lambda i: (-(tokens[i] if packed else tokens[i] * len(passes[i])),
                                                       min(passes[i])))
    return [sorted(passes[i]) for i in order]


def equalise(passes: list[list[int]], count: int) -> list[list[int] | None]:
    """`passes` made `count` long (`count` ≥ len(passes)): halve the pass with the most rows while one has
    more than one (a half never exceeds a budget its whole met), then pad with dummy passes (None)."""
    out: list[list[int] | None] = [list(members) for members in passes]
    while len(out) < count:
        largest = max(range(len(out)), key=lambda i: (len(out[i] or []), -i))
        members = out[largest]
        if members is None or len(members) < 2:
            out.extend([None] * (count - len(out)))
            break
        half = len(members) // 2
        out[largest:largest + 1] = [members[:half], members[half:]]
    return out


@dataclass(frozen=True)
class MicroBatching:
    """How the trainer splits a batch into passes (see the module docstring).

    rows: most rows per pass (`train.micro_batch_size`); max_tokens: most tokens per pass (0 = no
    budget, `train.max_tokens_per_micro_batch`); packed: the passes run packed (`train.packing`).
    """

    rows: int
    max_tokens: int = 0
    packed: bool = False

    def planned(self, lengths: Sequence[int]) -> int:
        """Passes this rank plans over rows of `lengths` (`plan_passes`). In a group of trainer ranks
        one may run more, split or dummy, to match the busiest rank (`equalise`)."""
        return len(plan_passes(lengths, self.rows, self.max_tokens, self.packed)) if len(lengths) else 0

    def update_passes(self, lengths: Sequence[int], mini_batches: int, epochs: int) -> int:
        """Training passes this rank plans over an update of rows of `lengths`: `planned` over each
        optimiser step's contiguous mini-batch (`shapes.mini_batch_slices`), `epochs` times."""
        return epochs * sum(self.planned(lengths[rows]) for rows in mini_batch_slices(len(lengths), mini_batches))

    def passes(self, batch: TokenBatch, device: torch.device) -> list[torch.Tensor | None]:
        """Row indices of each pass over `batch`, the same number on every trainer rank (a collective
        over the trainer group on `device` when there is a token budget); None marks a dummy pass."""
        lengths = batch.attention_mask.sum(dim=-1).tolist()
        plan: list[list[int] | None] = list(plan_passes(lengths, self.rows, self.max_tokens, self.packed))
        if self.max_tokens > 0 and dist.is_initialized() and dist.get_world_size() > 1:
            count = torch.tensor([len(plan)], dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            plan = equalise(plan, int(count))
        return [None if members is None else torch.tensor(members, dtype=torch.long) for members in plan]

    def parts(self, batch: TokenBatch, device: torch.device) -> Iterator[tuple[torch.Tensor | None, TokenBatch, slice]]:
        """For each pass (`passes`): its rows (None for a dummy pass), their sub-batch cropped to the
        columns they fill (`TokenBatch.crop`; a dummy pass carries the first row), and those columns."""
        for rows in self.passes(batch, device):
            part, cols = batch.select(slice(0, 1) if rows is None else rows).crop()
            yield rows, part, cols

    def gather(self, batch: TokenBatch, device: torch.device,
               forward: Callable[[TokenBatch], torch.Tensor]) -> torch.Tensor:
        """`forward(part)` (`[rows, cols]` per pass) of every pass, laid out as `[B, T]` (CPU fp32, 0 in the
        columns a pass cropped away); dummy passes run and are dropped."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows, part, cols in self.parts(batch, device):
            values = forward(part)
            if rows is not None:
                out[rows[:, None], torch.arange(cols.start, cols.stop)] = values.float().cpu()
        return out
