"""The driver of a diffusion job: checks the run directory, then runs its K controllers (this process for K = 1)."""

from __future__ import annotations

from gcore_rl.configlib import to_dict
from gcore_rl.diffusion.job import (
    FlowGrpoJobConfig,
    FlowRunSummary,
    check_output_dir,
    flow_controller,
    run_flow_grpo,
)
from gcore_rl.distributed import free_port
from gcore_rl.runtime.spawn import spawn_controllers


def run_flow_job(cfg: FlowGrpoJobConfig) -> FlowRunSummary:
    """Run a `kind: flow_grpo` job on `runtime.controllers` local processes; controller 0's summary."""
    if cfg.runtime.controllers == 1:
        return run_flow_grpo(cfg)
    check_output_dir(cfg)
    return spawn_controllers(flow_controller, (to_dict(cfg), free_port()), cfg.runtime.controllers, cfg.run.output_dir)
