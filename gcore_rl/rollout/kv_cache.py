"""A preallocated key/value pool of fixed slots, driven by the engine's scheduler.

Each of the engine's live sequences owns one *row* (slot) of the pool; rows `0 .. B-1` are the
live batch, kept contiguous so that attention reads a plain view `pool[:B, :, :span]` without a
copy. A row's tokens occupy columns `start .. end-1` (left padding before `start` comes from the
prefill batch the row was admitted with), so rows admitted at different times coexist in one
decode batch: every row has its own write column and its own mask.

The pool duck-types the part of `transformers.Cache` that decoder layers call
(`update(key_states, value_states, layer_idx)`); before each forward the engine says where the
new keys go (`plan_prefill` / `plan_decode`) and passes a ready 4-D boolean attention mask, which
`transformers` uses as given. Memory is allocated lazily, per layer, on the first write (shapes come
from the model's own key/value states, so any full-attention decoder works) and released by
`release()` (engine sleep).
"""

from __future__ import annotations

import inspect

import torch


class SlotKVCache:
    """Key/value tensors `[slots, kv_heads, capacity, head_dim]` per layer.

    Args:
        slots: rows of the pool (the engine's most concurrent sequences).
        capacity: columns per row (longest prompt + longest completion of a generate call).
        dtype / device: of the pool (the model's).
    """

    def __init__(self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.slots = slots
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self._rows = slice(0, 0)
        self._width = 0
        self._first_col = 0  # first column a prefill forward writes
        self._write_rows: torch.Tensor | None = None
        self._write_cols: torch.Tensor | None = None

    def fits(self, slots: int, capacity: int) -> bool:
        return slots <= self.slots and capacity <= self.capacity

    def nbytes(self) -> int:
        """Bytes held by the pool's allocated layers."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def release(self) -> int:
        """Free every layer's tensors; returns the bytes released."""
        released = self.nbytes()
        self.keys, self.values = [], []
        return released

    # ---- write plans (set before each forward) ----------------------------------------------

    def plan_prefill(self, first_row: int, rows: int, width: int, first_col: int = 0) -> None:
        """The next forward writes `[rows, H, width - first_col, D]` keys into rows `first_row ..`, columns
        `first_col .. width-1`, and attends over columns `0 .. width-1` (a chunk of a prefill whose earlier
        columns an earlier forward wrote; `first_col = 0` for a whole prefill)."""
        if first_row + rows > self.slots or width > self.capacity:
            raise ValueError(f"prefill of {rows} rows × {width} columns does not fit the pool "
                             f"({self.slots} slots × {self.capacity} columns) from row {first_row}")
        if not 0 <= first_col < width:
            raise ValueError(f"a prefill chunk starts at column {first_col}, outside 0 .. {width - 1}")
        self._rows, self._width, self._first_col = slice(first_row, first_row + rows), width, first_col
        self._write_rows = None

    def plan_decode(self, write_cols: torch.Tensor, span: int) -> None:
        """The next forward writes one key per live row `b` at column `write_cols[b]` (`[B]` long) and
        attends over columns `0 .. span-1` of rows `0 .. B-1`."""
        batch = write_cols.shape[0]
        self._rows, self._width = slice(0, batch), span
        self._write_rows = torch.arange(batch, device=write_cols.device)
        self._write_cols = write_cols

    # ---- the transformers Cache protocol used by decoder layers --------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values `[b, H, q, D]` and return the rows' full views `[b, H, span, D]`.

        Extra keyword arguments are ignored: transformers 5.23 passes `cache_kwargs`, 5.24 `kwargs=`
        (the attention call's keyword arguments); neither carries anything this cache needs."""
        keys, values = self._layer(layer_idx, key_states.shape[1], key_states.shape[3])
        rows, width = self._rows, self._width
        if self._write_rows is None:  # prefill: a dense block (columns first_col .. width-1)
            keys[rows, :, self._first_col:width] = key_states
            values[rows, :, self._first_col:width] = value_states
        else:  # decode: one column per row, each at its own position
            keys[self._write_rows, :, self._write_cols] = key_states[:, :, 0]
            values[self._write_rows, :, self._write_cols] = value_states[:, :, 0]
        return keys[rows, :, :width], values[rows, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width

    def _layer(self, layer_idx: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s key and value pools, allocated on first use."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None:
            shape = (self.slots, heads, self.capacity, head_dim)
            self.keys[layer_idx] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self.keys[layer_idx], self.values[layer_idx]

    # ---- blocks in and out (the prefix cache) ------------------------------------------------

    def read_block(self, row: int, first_col: int, end_col: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s keys and values in columns `first_col .. end_col-1`, per layer `[H, T, D]`."""
        return ([k[row, :, first_col:end_col].clone() for k in self.keys],
                [v[row, :, first_col:end_col].clone() for v in self.values])

    def write_block(self, row: int, first_col: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Row `row` takes `keys` and `values` (per layer `[H, T, D]`, from `read_block`) from column `first_col`."""
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            key_pool, value_pool = self._layer(layer, k.shape[0], k.shape[2])
            key_pool[row, :, first_col:first_col + k.shape[1]] = k
            value_pool[row, :, first_col:first_col + v.shape[1]] = v

    # ---- row moves ---------------------------------------------------------------------------

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Row `dst[i]` takes row `src[i]`'s columns `0 .. width-1` in every layer (sources read first,
        so the two may overlap)."""
        for pool in (*self.keys, *self.values):
            if pool is not None:
                pool[dst, :, :width] = pool[src, :, :width]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model.forward` takes its KV cache: `cache` (transformers 5.24, which warns that
    `past_key_values` is deprecated) or `past_key_values` (earlier)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_mask(start: torch.Tensor, end: torch.Tensor, span: int) -> torch.Tensor:
    """Boolean attention mask `[B, 1, 1, span]` of a decode step: row b sees columns `start[b] .. end[b]`
    (its own tokens, the one written this step included)."""
    cols = torch.arange(span, device=start.device)
    return ((cols >= start[:, None]) & (cols <= end[:, None]))[:, None, None, :]


def prefill_mask(start: torch.Tensor, width: int, first_col: int = 0) -> torch.Tensor:
    """Boolean mask `[P, 1, W - first_col, W]` of a left-padded prefill (or of its chunk whose queries are
    columns `first_col .. W-1`): causal over the row's own tokens (columns ≥ `start[p]`); a padding
    query sees only itself, so no row is fully masked (which would turn its outputs, and through them
    its cached keys, into NaN)."""
    cols = torch.arange(width, device=start.device)
    queries = cols[first_col:, None]
    causal = cols[None, :] <= queries
    own = (cols[None, None, :] >= start[:, None, None]) | (cols[None, :] == queries)
    return (causal[None] & own)[:, None]
