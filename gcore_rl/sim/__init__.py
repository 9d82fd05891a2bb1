"""Discrete-event simulator of a GRPO job with a generative judge on a GPU cluster.

It prices each phase of a step (generation with a long tail, judging, log-prob passes, training,
swaps, weight sync, the controllers' data plane) from hardware figures, model shapes and a few
constants, and compares placement strategies (colocate, partial, dynamic, disaggregated,
interleave) at 8-512 GPUs, for text generation (its prompts optionally with images, `workload.images`:
a vision-language policy) or (`workload.kind: diffusion`) RL on a text-to-image diffusion model.
See docs/simulator.md (the model) and docs/simulator-findings.md (what it predicts).
"""

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import HARDWARE, Hardware
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.models import MODELS, ModelSpec
from gcore_rl.costmodel.vision import ImageSettings
from gcore_rl.sim.results import PHASES, SimResult, StepRecord
from gcore_rl.sim.scenario import Scenario, load_scenario, resolve_job, variants
from gcore_rl.sim.simulator import run_scenario, simulate
from gcore_rl.sim.workload import LengthDistribution, ValidFractionSchedule, Workload, WorkloadTrace

__all__ = [
    "HARDWARE",
    "MODELS",
    "PHASES",
    "CostConstants",
    "Hardware",
    "ImageSettings",
    "Job",
    "LengthDistribution",
    "ModelSpec",
    "Scenario",
    "SimResult",
    "StepRecord",
    "ValidFractionSchedule",
    "Workload",
    "WorkloadTrace",
    "load_scenario",
    "resolve_job",
    "run_scenario",
    "simulate",
    "variants",
]
