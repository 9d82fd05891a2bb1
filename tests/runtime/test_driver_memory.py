"""The Ray driver carries no data: its peak memory stays flat as batch, payload and images grow.

Each case runs a whole job in a fresh driver process (so its peak resident memory, VmHWM, is that
job's) with 2 Ray controllers. The payload case gives every prompt row a 3×256×256 uint8 array (192 KiB; 600 rows
≈ 113 MiB, 56 MiB per controller) and quadruples the batch; the image case runs the tiny Qwen2-VL on
`shapes_vqa` with 2000 scenes of 256² pixels in place of 200 of 16² (the controllers draw, hold and
preprocess ~1000 × 192 KiB each). The driver's peak must not follow either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # the driver's memory over long Ray runs: `make test-slow`

MIB = 1024  # KiB
# The driver's own peak is VmHWM, the high-water mark of its address space: ru_maxrss would also count the peak
# of the process that started it (Linux carries that over across fork and exec), here pytest's.
DRIVER = """
import json, sys
from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.runtime.driver import run_job

quiet_hf_libraries()
model, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = load_config(JobConfig, None, [
    f"model.path={model}", f"run.output_dir={out}", "run.steps=2", "sampling.n=2", "sampling.max_new_tokens=3",
    "data.eval_prompts=0", "run.progress=false", "run.save_final=false",
    "runtime.kind=ray", "runtime.controllers=2", "runtime.threads_per_process=1", *overrides,
])
run_job(cfg)
vm_hwm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"driver_peak_kib": vm_hwm_kib}))
"""


@dataclass(frozen=True)
class Peaks:
    """Peak resident memory of one job: the driver's, and the largest of the controllers' (KiB)."""

    driver_kib: int
    controller_kib: float


def _peaks(tmp_path, model, name: str, *overrides: str) -> Peaks:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(out), json.dumps(overrides)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    controller_mib = max(step["memory/controller_peak_rss_mib_max"] for step in steps)
    return Peaks(json.loads(proc.stdout.strip().splitlines()[-1])["driver_peak_kib"], controller_mib * MIB)


def test_driver_peak_memory_does_not_grow_with_payload_or_batch(tmp_path):
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    rows = "data.num_prompts=600"
    small = _peaks(tmp_path, model, "small", rows, "data.payload_image_size=0", "run.prompts_per_step=4")
    large = _peaks(tmp_path, model, "large", rows, "data.payload_image_size=256", "run.prompts_per_step=16")
    payload_per_controller_kib = 300 * 3 * 256 * 256 // 1024
    # the controllers hold ~56 MiB more each; the driver may differ only by noise
    assert large.driver_kib - small.driver_kib < 24 * MIB, (small, large, payload_per_controller_kib)


def test_driver_peak_memory_does_not_grow_with_the_images_of_a_vision_policy(tmp_path):
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.models.vision import TinyVisionConfig

    model = write_tiny_model(tmp_path / "tiny-vl", TinyModelConfig(arch="qwen2_vl", hidden_size=32, num_layers=1,
                                                                   intermediate_size=64,
                                                                   vision=TinyVisionConfig(image_size=16)))
    task = "data.task=shapes_vqa"
    small = _peaks(tmp_path, model, "small", task, "data.task_options={size: 16}", "data.num_prompts=200",
                   "run.prompts_per_step=4")
    large = _peaks(tmp_path, model, "large", task, "data.task_options={size: 256}", "data.num_prompts=2000",
                   "run.prompts_per_step=8")
    # each controller holds its 1000 rows' scenes as decoded RGB images: 1000 × 256² × 3 B = 187.5 MiB (the small
    # job: 100 × 16² × 3 B = 75 KiB); the images really are there...
    payload_per_controller_kib = 1000 * 256 * 256 * 3 // 1024
    assert large.controller_kib - small.controller_kib > payload_per_controller_kib / 2, (small, large)
    # ...and the driver holds none of them: an eighth of one controller's images (23 MiB, what the driver would
    # hold if it carried just the rows of ~60 steps of 2 × 8 prompts) is far above the noise of two Ray driver runs
    # (a few MiB; the payload test above allows 24 MiB)
    assert large.driver_kib - small.driver_kib < payload_per_controller_kib / 8, (small, large)
