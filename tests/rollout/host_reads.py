"""Which operators of a block of code read tensor data back to the host or bring host data in (issue 49).

A CUDA graph records kernels; it cannot record the host waiting for a value (`.item()`, `bool(t)`, `nonzero`:
outputs whose value or shape depends on the data) nor a copy from pageable host memory, and the engine's
decode loop must not wait on the GPU between its counted reads. On a CPU these operators are visible to a
dispatch mode although nothing waits, so a test here sees what a capture or a per-token sync would meet there.
`.tolist()`, `.cpu()` and `.numpy()` of a CPU tensor read its memory without a dispatch and are not seen (the
engine's counted reads, `EngineStats.host_syncs`, use `.tolist()`); nor are reads below the dispatcher, such
as indexing with a boolean mask: `DeviceTraffic` on the `meta` device, where every read fails, sees those.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# operators whose result needs the data on the host: a value for Python, or an output shape set by the data
READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero.", "aten.masked_select",
         "aten._unique", "aten.unique", "aten.repeat_interleave.Tensor")
# a tensor made from Python data (`torch.tensor([...])`): on a GPU, a copy from host memory
UPLOADS = ("aten.lift_fresh",)


class HostReads(TorchDispatchMode):
    """Counts, by operator name, the host reads (`reads`) and uploads of host data (`uploads`) inside `with`."""

    def __init__(self):
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(READS):
            self.reads[name] += 1
        elif name.startswith(UPLOADS):
            self.uploads[name] += 1
        return func(*args, **(kwargs or {}))


def watch_static_steps(monkeypatch) -> list[HostReads]:
    """Records what every static-shape decode forward (`StaticDecode._step`, the step a graph captures) reads
    and uploads, one `HostReads` per step, for the rest of the test."""
    from gcore_rl.rollout.static_decode import StaticDecode

    steps, step = [], StaticDecode._step

    def watched(self, *inputs):
        with HostReads() as seen:
            out = step(self, *inputs)
        steps.append(seen)
        return out

    monkeypatch.setattr(StaticDecode, "_step", watched)
    return steps


class DeviceTraffic(TorchDispatchMode):
    """Counts the copies from the host to another device (`uploads`) and from a device back (`downloads`) inside
    `with`. Run with the model on the `meta` device, which holds no data, it sees on a CPU what a GPU would
    move: a copy up is counted, and any read of a device value fails (a meta tensor has none)."""

    def __init__(self):
        super().__init__()
        self.uploads = 0
        self.downloads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith(("aten._to_copy", "aten.copy_")):
            source = next(a for a in args if hasattr(a, "device"))
            target = args[0] if str(func).startswith("aten.copy_") else out
            if source is target:  # copy_(dst, src): the source is the second tensor
                source = args[1]
            self.uploads += source.device.type == "cpu" and target.device.type != "cpu"
            self.downloads += source.device.type != "cpu" and target.device.type == "cpu"
        return out
