"""What a run ran on: Python, the versions of the packages that shape its numbers, and the devices.

The driver writes it to `environment.json` when a run starts (`record_environment`), so a report
drawn later, on another machine, still shows the run's own environment.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
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
    return {"python": sys.version.split()[0], "platform": platform.platform(), "host": platform.node(),
            "cpu_count": os.cpu_count(), "packages": versions, "cuda": torch.version.cuda, "gpus": gpu_names()}


def gpu_names() -> list[str]:
    """The NVIDIA GPUs of this machine by name, from `nvidia-smi` (empty without one).

    Asked of the driver program rather than of torch: the job's driver must not create a CUDA
    context (it would hold memory on every GPU, and an exclusive-process GPU would refuse its worker).
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def record_environment(run_dir: str | Path) -> Path:
    """Write `environment.json` into the run directory and return its path."""
    path = Path(run_dir) / ENVIRONMENT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(environment_info(), indent=2) + "\n", encoding="utf-8")
    return path
