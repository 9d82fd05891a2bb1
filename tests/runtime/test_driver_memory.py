"""The Ray driver carries no data: its peak memory stays flat as batch and payload grow.

Each case runs a whole job in a fresh driver process (so `ru_maxrss` is that job's peak) with 2
Ray controllers. The large case gives every prompt row a 3×256×256 uint8 image (192 KiB; 600 rows
≈ 113 MiB per controller) and quadruples the batch; the driver's peak must not follow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")

DRIVER = """
import json, resource, sys
from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.runtime.driver import run_job
quiet_hf_libraries()
model, out, image, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(JobConfig, None, [
    f"model.path={model}", f"run.output_dir={out}", "run.steps=2", f"run.prompts_per_step={prompts}",
    "sampling.n=2", "sampling.max_new_tokens=3", "data.eval_prompts=0", "data.num_prompts=600",
    f"data.payload_image_size={image}", "run.progress=false", "run.save_final=false",
    "runtime.kind=ray", "runtime.controllers=2", "runtime.threads_per_process=1",
])
run_job(cfg)
print(json.dumps({"driver_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _driver_peak_kib(tmp_path, model, name: str, image: int, prompts: int) -> int:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(tmp_path / name), str(image), str(prompts)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["driver_peak_kib"]


def test_driver_peak_memory_does_not_grow_with_payload_or_batch(tmp_path):
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    small = _driver_peak_kib(tmp_path, model, "small", image=0, prompts=4)
    large = _driver_peak_kib(tmp_path, model, "large", image=256, prompts=16)
    payload_per_controller_kib = 600 * 3 * 256 * 256 // 1024
    # the controllers hold ~113 MiB more each; the driver may differ only by noise
    assert large - small < 24 * 1024, (small, large, payload_per_controller_kib)
