"""What a run ran on: Python, the versions of the packages that shape its numbers, and the devices.

The driver writes it to `environment.json` when a run starts (`record_environment`), so a report
drawn later, on another machine, still shows the run's own environment.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from gcore_rl.report.rundata import ENVIRONMENT

PACKAGES = ("gcore-rl", "torch", "transformers", "tokenizers", "safetensors", "numpy", "ray", "plotly")
"""Distributions whose versions are recorded (those not installed are left out)."""


def environment_info() -> dict[str, Any]:
    """Python, platform, package versions and devices of this process's machine."""
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cuda = torch.version.cuda
    else:
        devices, cuda = [], None
    return {"python": sys.version.split()[0], "platform": platform.platform(), "host": platform.node(),
            "cpu_count": os.cpu_count(), "packages": versions, "cuda": cuda, "gpus": devices}


def record_environment(run_dir: str | Path) -> Path:
    """Write `environment.json` into the run directory and return its path."""
    path = Path(run_dir) / ENVIRONMENT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(environment_info(), indent=2) + "\n", encoding="utf-8")
    return path
