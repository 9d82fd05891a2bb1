"""Entry points: simulate one strategy on a scenario, or every strategy on every sweep variant.

    from gcore_rl.sim import load_scenario, run_scenario
    results = run_scenario(load_scenario("scenarios/gpus64_judge.yaml"))
    for r in results:
        print(r.label, r.mean_step_seconds, r.utilisation()["idle"])

Every strategy of a scenario sees the same work (`WorkloadTrace` from the same seed); the
differences between results come from placement alone, and from the one rule placement imposes on
the work: with dynamic sampling, strategies that roll out ahead drop the surplus groups an on-policy
strategy trains one step later (`surplus_rule`), and generate their prompts again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.errors import ConfigError
from gcore_rl.sim.disaggregated import Disaggregated
from gcore_rl.sim.results import SimResult
from gcore_rl.sim.scenario import SIM_STRATEGIES, Scenario, resolve_job, variants
from gcore_rl.sim.strategies import Colocate, Dynamic, Interleave, Partial
from gcore_rl.sim.streaming import Streaming
from gcore_rl.sim.workload import StepWork, SurplusRule, WorkloadTrace

RUNNERS = {"colocate": Colocate, "partial": Partial, "dynamic": Dynamic, "disaggregated": Disaggregated,
           "interleave": Interleave, "streaming": Streaming}


def _check(strategies: Sequence[str]) -> None:
    for name in strategies:
        if name not in RUNNERS:
            raise ConfigError("strategies", f"unknown strategy {name!r}; known: {', '.join(SIM_STRATEGIES)}")


def surplus_rule(scenario: Scenario, strategy: str) -> SurplusRule:
    """How old `strategy`'s buffered surplus groups may be: `disaggregated` rolls out one update ahead (the
    trainer's default `placement.max_staleness`), `streaming` up to `placement.max_staleness`; the others
    are on-policy (`dynamic_sampling.max_surplus_age`)."""
    if strategy == "disaggregated":
        return SurplusRule.ahead(1)
    if strategy == "streaming":
        return SurplusRule.ahead(scenario.placement.max_staleness)
    return SurplusRule.on_policy(scenario.workload)


def workload_steps(scenario: Scenario, strategy: str = "colocate") -> list[StepWork]:
    """The work of every step of `scenario` as `strategy` does it (deterministic in the seed; the same for
    every strategy with the same `surplus_rule`, and for all of them without dynamic sampling)."""
    return list(WorkloadTrace(scenario.workload, scenario.controllers, scenario.steps, scenario.seed,
                              surplus_rule(scenario, strategy)).steps())


def simulate(scenario: Scenario, strategy: str, variant: str = "",
             works: Sequence[StepWork] | None = None) -> SimResult:
    """Simulate `scenario.steps` steps of `strategy` on `scenario` (its sweep is ignored).

    `works` (from `workload_steps(scenario, strategy)`) saves drawing the same work again for each strategy.
    """
    _check([strategy])
    if strategy not in scenario.strategies:
        scenario = replace(scenario, strategies=(*scenario.strategies, strategy))  # check its splits too
    job = resolve_job(scenario)
    works = workload_steps(scenario, strategy) if works is None else works
    timeline = Timeline(job.gpus)
    records = RUNNERS[strategy](job).run(works, timeline)
    return SimResult(scenario=scenario.name, strategy=strategy, variant=variant, gpus=job.gpus,
                     controllers=job.controllers, steps=records, timeline=timeline)


def run_scenario(scenario: Scenario, strategies: Sequence[str] | None = None) -> list[SimResult]:
    """Every strategy (default: the scenario's) on every sweep variant, variant-major."""
    chosen = tuple(strategies) if strategies else tuple(scenario.strategies)
    _check(chosen)
    results = []
    for label, variant in variants(scenario):
        variant = replace(variant, strategies=chosen)
        resolve_job(variant)  # splits of the chosen strategies
        works: dict[SurplusRule, list[StepWork]] = {}
        for name in chosen:
            rule = surplus_rule(variant, name)
            if rule not in works:
                works[rule] = workload_steps(variant, name)
            results.append(simulate(variant, name, label, works[rule]))
    return results
