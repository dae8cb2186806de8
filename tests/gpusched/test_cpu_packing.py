"""Packing on cores as well as cards: the pure policy, with plain jobs, cards and completions.

Each job counts its learnt CPU use (``Job.cpu``, cores) against the node's
budget (``cpu_slots``); no process is started here.
"""

from __future__ import annotations

import pytest

from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.scheduling import Assignment, Job, Packer, cpu_demand, simulate
from gpusched.scheduling.cluster import ClusterPolicy, Node, Placement
from gpusched.scheduling.packing import MIN_CPU, UNMEASURED_CPU_FILE, UNMEASURED_GPU_FILE


def cards(n: int) -> list[Card]:
    return [Card(str(i)) for i in range(n)]


def job(i: int, gpus: int = 0, cpu: float | None = None, expected: float = 1.0) -> Job:
    return Job(i, f"test_{i}.py", Requirement(gpus), expected, cpu)


def started(decisions) -> set[int]:
    return {d.job.id for d in decisions if isinstance(d, Assignment)}


def test_a_job_counts_its_measured_use_at_least_the_floor_and_at_most_the_budget():
    assert cpu_demand(job(0, cpu=1.5), 4) == 1.5
    assert cpu_demand(job(0, gpus=2, cpu=0.7), 4) == 0.7
    assert cpu_demand(job(0, cpu=0.01), 4) == MIN_CPU
    assert cpu_demand(job(0, cpu=9.0), 4) == 4.0  # alone it still fits


def test_a_job_never_measured_counts_one_core_without_gpus_and_none_beside_its_cards():
    assert cpu_demand(job(0), 4) == UNMEASURED_CPU_FILE == 1.0
    assert cpu_demand(job(0, gpus=1), 4) == UNMEASURED_GPU_FILE == 0.0


def test_jobs_start_while_their_use_fits_in_the_budget():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(0, cpu=1.2, expected=9), job(1, cpu=0.5, expected=8), job(2, cpu=0.7)])
    # 1.2 + 0.5 fit in 2 cores; the 0.7 would make 2.4, farther from 2 than the 1.7 without it.
    assert started(packer.schedule()) == {0, 1}
    assert packer.cpu_free == pytest.approx(0.3)
    packer.complete(1)
    assert started(packer.schedule()) == {2}


def test_a_job_a_little_over_the_free_cores_starts_rather_than_leave_them_idle():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(0, cpu=0.8, expected=9), job(1, cpu=0.8, expected=8)])
    packer.submit([job(2, cpu=0.6, expected=7), job(3, cpu=0.1)])
    # 0.8 + 0.8 leave 0.4 free: 0.6 is over by 0.2 (load 2.2, nearer 2 than 1.6 is);
    # after it nothing is free, so even the 0.1 waits.
    assert started(packer.schedule()) == {0, 1, 2}
    assert packer.cpu_free == pytest.approx(-0.2)
    packer.complete(2)
    assert started(packer.schedule()) == {3}


def test_a_job_twice_the_free_cores_or_more_waits():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(0, cpu=1.5, expected=9), job(1, cpu=1.0)])
    # 0.5 free; 1.0 would make 2.5, as far from 2 as the 1.5 without it.
    assert started(packer.schedule()) == {0}


def test_a_gpu_file_never_measured_starts_on_its_cards_even_with_the_cores_over_budget():
    packer = Packer(cards(1), cpu_slots=2)
    packer.submit([job(0, cpu=0.9, expected=9), job(1, cpu=0.9, expected=8), job(2, cpu=0.3)])
    assert started(packer.schedule()) == {0, 1, 2}  # 2.1 counted
    packer.submit([job(3, gpus=1)])
    assert started(packer.schedule()) == {3}


def test_light_files_run_more_at_once_than_there_are_cores():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(i, cpu=0.25) for i in range(10)])
    assert started(packer.schedule()) == set(range(8))


def test_the_floor_bounds_how_many_idle_files_share_a_core():
    packer = Packer([], cpu_slots=1)
    packer.submit([job(i, cpu=0.0) for i in range(12)])
    assert len(started(packer.schedule())) == round(1 / MIN_CPU)


def test_gpu_files_count_their_cores_too():
    packer = Packer(cards(2), cpu_slots=2)
    packer.submit([job(0, gpus=1, cpu=1.5), job(1, cpu=1.0)])
    # The card is free and so would be a CPU slot; the cores are not.
    assert started(packer.schedule()) == {0}
    packer.submit([job(2, gpus=1, cpu=0.4)])
    assert started(packer.schedule()) == {2}  # a GPU file that fits beside still starts
    packer.complete(0)
    assert started(packer.schedule()) == {1}


def test_a_gpu_file_waits_for_cores_even_with_its_cards_free():
    packer = Packer(cards(4), cpu_slots=2)
    packer.submit([job(0, cpu=2.0, expected=9), job(1, gpus=2, cpu=1.0)])
    assert started(packer.schedule()) == {1}  # GPU files first: 1 core left, the CPU file waits
    packer.complete(1)
    assert started(packer.schedule()) == {0}


def test_unmeasured_files_pack_as_cpu_slots_did():
    """A first run: each CPU file takes one of ``cpu_slots`` cores, GPU files only cards."""
    packer = Packer(cards(1), cpu_slots=2)
    packer.submit([job(0), job(1), job(2), job(3, gpus=1)])
    assert started(packer.schedule()) == {0, 1, 3}
    packer.complete(0)
    assert started(packer.schedule()) == {2}


def test_a_file_that_needs_more_than_the_budget_runs_alone():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(0, cpu=0.5, expected=1), job(1, cpu=3.5, expected=9)])
    assert started(packer.schedule()) == {1}  # longest first, on an empty node
    packer.submit([job(2, cpu=0.1)])
    assert started(packer.schedule()) == set()  # nothing beside it
    packer.complete(1)
    assert started(packer.schedule()) == {0, 2}


def test_a_big_file_queued_behind_running_ones_starts_once_they_are_done():
    packer = Packer([], cpu_slots=2)
    packer.submit([job(0, cpu=1.0, expected=5)])
    assert started(packer.schedule()) == {0}
    packer.submit([job(1, cpu=4.0, expected=9)])
    assert started(packer.schedule()) == set()
    packer.complete(0)
    assert started(packer.schedule()) == {1}


def test_reserved_cores_count_until_released_and_an_adopted_file_counts_its_own_use():
    packer = Packer([], cpu_slots=3)
    packer.reserve_cpu(2)  # an early start and the collection
    packer.submit([job(0, cpu=1.0, expected=9), job(1, cpu=1.5)])
    assert started(packer.schedule()) == {0}
    packer.adopt(job(5, cpu=0.25))  # the early start: 1 reserved core becomes 0.25
    # 1 + 0.25 + the collection's 1 = 2.25: 0.75 free, and 1.5 is not less than twice that.
    assert started(packer.schedule()) == set()
    packer.release_cpu(1)  # the collection is done
    assert started(packer.schedule()) == {1}
    assert packer.cpu_free == pytest.approx(0.25)


def test_on_a_virtual_clock_light_files_overlap_and_heavy_ones_queue():
    light = [job(i, cpu=0.5, expected=10.0) for i in range(4)]
    runs, _ = simulate([], light, cpu_slots=2)
    assert max(run.end for run in runs) == 10.0  # all four at once
    unmeasured = [job(i, expected=10.0) for i in range(4)]
    runs, _ = simulate([], unmeasured, cpu_slots=2)
    assert max(run.end for run in runs) == 20.0  # one core each: two at a time
    near_half = [job(i, cpu=0.7, expected=10.0) for i in range(6)]
    runs, _ = simulate([], near_half, cpu_slots=2)
    assert max(run.end for run in runs) == 20.0  # three at a time (2.1), not two (1.4)
    heavy = [job(i, cpu=1.5, expected=10.0) for i in range(2)]
    runs, _ = simulate([], heavy, cpu_slots=2)
    assert sorted((run.start, run.end) for run in runs) == [(0.0, 10.0), (10.0, 20.0)]


def node(name: str, gpus: int, cpu_slots: int) -> Node:
    return Node(name, name, tuple(cards(gpus)), cpu_slots)


def placed(decisions) -> dict[int, str]:
    return {d.job.id: d.node for d in decisions if isinstance(d, Placement)}


def test_each_node_of_a_cluster_has_its_own_budget():
    policy = ClusterPolicy([node("small", 0, 1), node("big", 0, 4)])
    policy.submit([job(i, cpu=1.8, expected=9 - i) for i in range(3)] + [job(3, cpu=0.5)])
    # 1.8-core files wait for the 4-core node (two at a time there): none runs alone on
    # the 1-core node. The 0.5-core file goes where most cores are free.
    assert placed(policy.schedule()) == {0: "big", 1: "big", 3: "small"}
    policy.complete(0)
    assert placed(policy.schedule()) == {2: "big"}


def test_a_file_more_than_every_node_has_runs_alone_on_one():
    policy = ClusterPolicy([node("a", 0, 2), node("b", 0, 2)])
    policy.submit([job(0, cpu=3.0, expected=9), job(1, cpu=3.0, expected=8), job(2, cpu=0.5)])
    assert placed(policy.schedule()) == {0: "a", 1: "b"}
    policy.complete(1)
    assert placed(policy.schedule()) == {2: "b"}


def test_a_gpu_file_goes_to_a_node_whose_cores_have_room():
    policy = ClusterPolicy([node("busy", 2, 2), node("idle", 4, 2)])
    policy.submit([job(0, cpu=2.0, expected=9)])
    assert placed(policy.schedule()) == {0: "busy"}  # the CPU file fills the first node's cores
    policy.submit([job(1, gpus=2, cpu=1.0)])
    # Best fit on cards would choose "busy" (2 free cards); its cores are taken.
    assert placed(policy.schedule()) == {1: "idle"}
