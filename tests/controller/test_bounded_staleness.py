"""The bounded-staleness schedule of `OneStepOff` (controller/schedules.py), replayed on step numbers alone.

Step t pops its rollout (or makes it), starts the update, and while the trainers work makes the rollouts
up to `rollouts_ahead_until(t, ...)` with the engines' weights, version t-1; step s then trains at trainer
version s-1. The Ray test (tests/runtime/test_ray_staleness.py) checks the same numbers on a real run.
"""

from __future__ import annotations

import pytest

from gcore_rl.controller.schedules import rollouts_ahead_until


def schedule(k: int, steps: int, saves_at: frozenset[int] = frozenset(), first: int = 1,
             ahead: dict[int, int] | None = None) -> tuple[dict[int, int], dict[int, int]]:
    """Replay steps `first`..`steps`: the engine version each trained step's rollout was made with, and the
    queue left at the end of each step as {step: version} (`ahead`: the queue a resume starts from)."""
    queue = dict(ahead or {})
    made_with, queues = {}, {}
    for step in range(first, steps + 1):
        made_with[step] = queue.pop(step) if step in queue else step - 1  # made now, on the weights of step-1
        saves = any(later in saves_at for later in range(step, steps + 1))
        for ahead_step in range(step + len(queue) + 1, rollouts_ahead_until(step, k, steps, saves) + 1):
            queue[ahead_step] = step - 1
        queues[step] = dict(queue)
    return made_with, queues


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_staleness_never_exceeds_k_and_reaches_it(k):
    made_with, queues = schedule(k, steps=12)
    staleness = [step - 1 - version for step, version in made_with.items()]
    assert staleness == [min(step - 1, k) for step in range(1, 13)]
    assert all(len(queue) <= k for queue in queues.values())
    assert max(len(queue) for queue in queues.values()) == k


def test_one_step_off_is_k_one():
    made_with, queues = schedule(1, steps=4)
    assert made_with == {1: 0, 2: 0, 3: 1, 4: 2}  # step t+1 rolled out on the weights of t-1 while t trains
    assert [len(queue) for queue in queues.values()] == [1, 1, 1, 0]  # nothing past the last step ...
    assert schedule(1, steps=4, saves_at=frozenset({4}))[1][4] == {5: 3}  # ... unless it saves


@pytest.mark.parametrize("k", [2, 3])
def test_a_save_keeps_the_queue_a_longer_run_would_have(k):
    whole, whole_queues = schedule(k, steps=9)
    short, queues = schedule(k, steps=4, saves_at=frozenset({2, 4}))
    assert queues[4] == whole_queues[4] and len(queues[4]) == k  # made during the same steps, same weights
    resumed, _ = schedule(k, steps=9, first=5, ahead=queues[4])
    assert {**short, **resumed} == whole
