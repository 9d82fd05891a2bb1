"""The restricted unpickler for DCP's `.metadata`: what a real save pickles loads, nothing else does."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from gcore_rl.checkpoint.unpickle import RefusedGlobal, unpickle_metadata


def _global(module: str, name: str) -> bytes:
    """A protocol-0 pickle of the bare global ``module.name``."""
    return f"c{module}\n{name}\n.".encode()


def test_a_tensor_entry_of_every_dtype_and_layout_round_trips():
    entries = [TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size([2, 3]),
                                     [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))])
               for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)]
    data = pickle.dumps(OrderedDict(entries=entries, shape=torch.Size([4]), names={"a", "b"}))
    assert unpickle_metadata(data) == OrderedDict(entries=entries, shape=torch.Size([4]), names={"a", "b"})


@pytest.mark.parametrize("module, name", [
    ("builtins", "eval"),
    ("os", "system"),
    ("torch", "load"),  # a torch attribute that is not a dtype
    ("torch", "tensor"),
    ("torch.distributed.checkpoint.metadata", "os"),  # imported into the module, not a class of it
    ("torch.distributed.checkpoint.metadata", "field"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
])
def test_every_other_global_is_refused_by_name(module, name):
    with pytest.raises(RefusedGlobal, match=f"{module}.{name}".replace(".", r"\.")):
        unpickle_metadata(_global(module, name))
