"""bench/harness/shaped_link.py binds each rank of a job to its own core when there are enough."""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import shaped_link as L  # noqa: E402

AFFINITY = ["-c", "import os; print(sorted(os.sched_getaffinity(0)))"]


def _affinities(world: int, monkeypatch) -> list[list[int]]:
    monkeypatch.setattr(L, "NETNS", [False])  # every rank on this host: no namespaces needed
    return [ast.literal_eval(out.strip().splitlines()[-1]) for out in L.spawn_ranks(AFFINITY, world, namespaces=1)]


def test_each_rank_runs_on_its_own_core_when_there_is_one_per_rank(monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    world = min(2, len(mine))
    assert _affinities(world, monkeypatch) == [[c] for c in mine[:world]]


def test_ranks_that_outnumber_the_cores_are_left_to_the_scheduler(monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    assert _affinities(len(mine) + 1, monkeypatch) == [mine] * (len(mine) + 1)
