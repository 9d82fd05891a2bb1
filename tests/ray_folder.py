"""A Ray instance whose worker processes import the modules of a test folder (a backend, tools, a parser written
for the test), shared by the test folders that need one (their conftest puts this folder on `sys.path`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def ray_importing(ray, folder: Path, devices: int = 2) -> Iterator[None]:
    """Ray with `devices` logical devices, `folder` on every worker's PYTHONPATH (set before Ray starts); the
    environment is restored when it shuts down."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), saved) if p)
    ray.init(num_cpus=2, resources={"device": devices}, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
