"""The one unpickler a checkpoint is read with: DCP's `.metadata`, and only the globals it is made of.

DCP writes its index of the saved tensors (``trainer/.metadata``) with `pickle`. A plain
`pickle.load` of a file someone planted or damaged could call any function; `MetadataUnpickler`
resolves only the globals a real `Metadata` references (found by pickling one from `dcp.save` and
listing them) and refuses every other by name.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each tensor lies in a shard
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name (torch.strided)
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # the same from Python 3.13 on
    ("builtins", "set"), ("builtins", "frozenset"),
})


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global that the metadata unpickler does not accept."""

    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualified_name = f"{module}.{name}"


def _is_dcp_metadata_class(module: str, name: str) -> bool:
    """A class defined in DCP's metadata module (Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...)."""
    if module != _DCP_METADATA_MODULE:
        return False
    import torch.distributed.checkpoint.metadata as dcp_metadata

    found = getattr(dcp_metadata, name, None)
    return isinstance(found, type) and found.__module__ == module


def _is_torch_dtype(module: str, name: str) -> bool:
    """``torch.float32`` and the like: pickled as a lookup of a `torch.dtype` attribute of `torch`."""
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `Metadata` and nothing else: any other global raises `RefusedGlobal`.

    Accepted: classes defined in ``torch.distributed.checkpoint.metadata``, the filesystem
    writer's ``_StorageInfo``, ``torch.Size``, torch dtypes (``torch.float32`` ...),
    ``torch.serialization._get_layout``, ``collections.OrderedDict``, POSIX paths, and sets.
    """

    def find_class(self, module: str, name: str) -> Any:
        """Resolve an accepted global; raise `RefusedGlobal` for every other."""
        if (module, name) in _ALLOWED_GLOBALS or _is_dcp_metadata_class(module, name) or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise RefusedGlobal(module, name)


def unpickle_metadata(data: bytes) -> Any:
    """Unpickle `data` with `MetadataUnpickler` (RefusedGlobal, or the usual unpickling errors, when it is not DCP's)."""
    return MetadataUnpickler(io.BytesIO(data)).load()
