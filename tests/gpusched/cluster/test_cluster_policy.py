"""The pure cluster policy, the agent's pinned policy and the versions check: no Ray, no process."""

from __future__ import annotations

import pytest

from gpusched.execution.cluster.agent import NodeInfo
from gpusched.execution.cluster.driver import node_names
from gpusched.execution.cluster.versions import differences
from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.scheduling.cluster import (
    ClusterPolicy,
    Node,
    PinnedPolicy,
    Placement,
    cluster_requirement,
    simulate_cluster,
)
from gpusched.scheduling.order import queue_order
from gpusched.scheduling.packing import Assignment, Job, Unschedulable

GB = 10**9


def cards(count: int, memory: int | None = None) -> tuple[Card, ...]:
    return tuple(Card(str(i), memory) for i in range(count))


def job(i: int, gpus: int, expected: float = 1.0, memory: int | None = None) -> Job:
    return Job(i, f"test_{i}.py", Requirement(gpus, memory), expected)


def cluster(*sizes: int, cpu_slots: int = 1) -> ClusterPolicy:
    return ClusterPolicy(
        [Node(f"n{i}", f"node{i}", cards(n), cpu_slots) for i, n in enumerate(sizes)]
    )


def placed(decisions) -> dict[int, tuple[str, tuple[str, ...]]]:
    return {
        d.job.id: (d.node, tuple(c.id for c in d.cards))
        for d in decisions
        if isinstance(d, Placement)
    }


def test_largest_first_never_spanning_nodes():
    policy = cluster(4, 4, 2)
    policy.submit([job(0, 1), job(1, 4), job(2, 2), job(3, 4), job(4, 2)])
    where = placed(policy.schedule())
    assert where[1][0] != where[3][0] and {where[1][0], where[3][0]} == {"n0", "n1"}
    assert where[1][1] == where[3][1] == ("0", "1", "2", "3")
    assert where[2] == ("n2", ("0", "1"))  # the 2-card node is the tightest fit for a 2-card job
    assert 4 not in where and 0 not in where  # nothing left for them until a node frees cards
    policy.complete(2)
    where = placed(policy.schedule())
    assert where == {4: ("n2", ("0", "1"))}  # larger first: the 2-card job before the 1-card one


def test_longest_expected_first_among_equal_sizes():
    policy = cluster(1)
    policy.submit([job(0, 1, 2.0), job(1, 1, 9.0), job(2, 1, 5.0)])
    assert list(placed(policy.schedule())) == [1]
    policy.complete(1)
    assert list(placed(policy.schedule())) == [2]


def test_whole_node_jobs_first_even_when_shorter():
    policy = cluster(4)
    policy.submit([job(0, 1, 9.0), job(1, 4, 1.0)])
    assert list(placed(policy.schedule())) == [1]


def test_with_history_longest_expected_first_whatever_the_width():
    policy = cluster(4)
    policy.submit([job(0, 2, 1.0), job(1, 2, 1.5), job(2, 1, 9.0), job(3, 1, 8.0), job(4, 1, 7.0)])
    assert set(placed(policy.schedule())) == {2, 3, 4}  # one card left: no 2-card job fits


def test_first_run_the_width_with_most_pending_files_first():
    # Every file expects the same (no history): whole-node files, then the longest queue.
    policy = cluster(4, 4)
    policy.submit([job(0, 2), job(1, 1), job(2, 1), job(3, 4), job(4, 1), job(5, 2)])
    where = placed(policy.schedule())
    assert where == {
        3: ("n0", ("0", "1", "2", "3")),
        1: ("n1", ("0",)),
        2: ("n1", ("1",)),
        4: ("n1", ("2",)),
    }  # three 1-card files before two 2-card ones; the 2-card files wait for n0
    policy.complete(3)
    assert placed(policy.schedule()) == {0: ("n0", ("0", "1")), 5: ("n0", ("2", "3"))}


def test_first_run_equal_queues_wider_first_then_file_order():
    policy = cluster(3)
    policy.submit([job(0, 1), job(1, 2), job(2, 1), job(3, 2)])
    assert list(placed(policy.schedule())) == [1, 0]


def test_queue_order_puts_cpu_jobs_last_longest_first():
    jobs = [job(0, 0, 1.0), job(1, 0, 5.0), job(2, 1, 1.0), job(3, 4, 1.0)]
    assert [j.id for j in queue_order(jobs, whole_node=4)] == [3, 2, 1, 0]


def test_best_fit_on_memory_across_nodes():
    policy = ClusterPolicy(
        [
            Node("big", "big", cards(2, 80 * GB), 1),
            Node("small", "small", cards(2, 40 * GB), 1),
        ]
    )
    policy.submit([job(0, 1, memory=30 * GB), job(1, 1, memory=60 * GB)])
    where = placed(policy.schedule())
    assert where[0][0] == "small" and where[1][0] == "big"


def test_cpu_files_go_to_the_node_with_most_free_slots():
    policy = ClusterPolicy([Node("a", "a", (), 1), Node("b", "b", cards(1), 3)])
    policy.submit([job(i, 0) for i in range(5)])
    where = placed(policy.schedule())
    assert sorted(node for node, _ in where.values()) == ["a", "b", "b", "b"]
    assert policy.has_pending


def test_unschedulable_names_the_largest_node():
    policy = cluster(4, 2)
    policy.submit([job(0, 8)])
    (decision,) = policy.schedule()
    assert isinstance(decision, Unschedulable)
    assert decision.reason == "needs 8 GPUs, the largest node (node0) has 4"


def test_no_gpus_in_the_cluster_skips_gpu_files_and_runs_cpu_files():
    policy = ClusterPolicy([Node("a", "a", (), 2), Node("b", "b", (), 1)])
    policy.submit([job(0, 1), job(1, 0), job(2, 2)])
    decisions = policy.schedule()
    skipped = {d.job.id: d.reason for d in decisions if isinstance(d, Unschedulable)}
    assert skipped == {
        0: "needs 1 GPUs, no node of the cluster has any",
        2: "needs 2 GPUs, no node of the cluster has any",
    }
    assert list(placed(decisions)) == [1]


def test_memory_reason_names_the_node_with_most_such_cards():
    policy = ClusterPolicy(
        [Node("a", "a", cards(4, 40 * GB), 1), Node("b", "b", (Card("0", 80 * GB),), 1)]
    )
    policy.submit([job(0, 2, memory=80 * GB)])
    (decision,) = policy.schedule()
    assert (
        decision.reason
        == "needs 2 GPUs with >= 80GB on one node, the most such cards on one node is 1 (b)"
    )


def test_removed_node_hands_back_its_running_jobs_and_shrinks_the_cluster():
    policy = cluster(4, 2)
    policy.submit([job(0, 4), job(1, 2)])
    where = placed(policy.schedule())
    assert where == {0: ("n0", ("0", "1", "2", "3")), 1: ("n1", ("0", "1"))}
    policy.submit([job(2, 4)])
    assert policy.schedule() == []  # waits for node n0
    lost = policy.remove_node("n0")
    assert [j.id for j in lost] == [0]
    assert policy.running.keys() == {1}
    decisions = policy.schedule()  # no node can ever run a 4-card job now
    assert [d.reason for d in decisions] == ["needs 4 GPUs, the largest node (node1) has 2"]


def test_no_node_left_makes_every_pending_job_unschedulable():
    policy = cluster(2)
    policy.remove_node("n0")
    policy.submit([job(0, 0), job(1, 1)])
    reasons = sorted(d.reason for d in policy.schedule())
    assert reasons == ["no node of the cluster is left", "no node of the cluster is left"]


def test_quarantined_cards_are_never_handed_out_again():
    policy = cluster(2)
    policy.submit([job(0, 2)])
    policy.schedule()
    policy.complete(0, quarantined=["1"])
    policy.submit([job(1, 1), job(2, 2)])
    decisions = policy.schedule()
    assert placed(decisions) == {1: ("n0", ("0",))}
    assert [d.job.id for d in decisions if isinstance(d, Unschedulable)] == [2]


def test_cluster_requirement_lowers_to_a_level_some_node_fits():
    nodes = [Node("a", "a", cards(4), 1), Node("b", "b", cards(2), 1)]
    levels = (Requirement(1), Requirement(2), Requirement(8))
    assert cluster_requirement(Requirement(8), levels, nodes) == Requirement(2)
    assert cluster_requirement(Requirement(4), levels, nodes) == Requirement(4)
    assert cluster_requirement(Requirement(8), (Requirement(8),), nodes) == Requirement(8)


def test_simulated_makespan_uses_every_node():
    nodes = [Node("a", "a", cards(4), 1), Node("b", "b", cards(4), 1)]
    runs, skipped = simulate_cluster(nodes, [job(i, 4, 3.0) for i in range(4)] + [job(9, 8)])
    assert max(run.end for run in runs) == 6.0
    assert {run.node for run in runs} == {"a", "b"}
    assert [j.id for j, _ in skipped] == [9]


def test_pinned_policy_starts_on_the_drivers_cards_and_reruns_there():
    policy = PinnedPolicy()
    first, second = job(0, 2), job(1, 1)
    policy.place(first, cards(2))
    policy.place(second, (Card("1"),))
    policy.submit([first, second])
    assert policy.schedule() == [Assignment(first, cards(2))]  # card 1 is taken: second waits
    policy.complete(0)
    policy.submit([first])  # a rerun goes back to its own cards
    assert policy.schedule() == [Assignment(second, (Card("1"),))]
    assert policy.cancel_pending() == [first]
    with pytest.raises(KeyError, match="never placed"):
        policy.submit([job(7, 0)])


def test_differences_name_what_differs():
    here = {"python": "CPython 3.11.7", "pytest": "9.2.0", "plugin pytest-timeout": "2.4.0"}
    there = {"python": "CPython 3.11.7", "pytest": "9.1.0"}
    assert differences(here, there) == [
        "plugin pytest-timeout 2.4.0 here, missing there",
        "pytest 9.2.0 here, 9.1.0 there",
    ]
    assert differences(here, dict(here)) == []


def test_node_names_add_the_id_only_where_hosts_repeat():
    def info(node_id: str, host: str) -> NodeInfo:
        return NodeInfo(node_id, host, (), False, 1, {}, 1)

    names = node_names(
        [info("aaaaaa11", "gpu1"), info("bbbbbb22", "gpu2"), info("cccccc33", "gpu2")]
    )
    assert names == ["gpu1", "gpu2-bbbbbb", "gpu2-cccccc"]


def test_a_node_that_joins_takes_jobs_from_the_next_decision_on():
    policy = cluster(2)
    policy.submit([job(0, 2), job(1, 2), job(2, 1)])
    assert placed(policy.schedule()) == {0: ("n0", ("0", "1"))}
    policy.add_node(Node("n9", "late", cards(4), 1))
    where = placed(policy.schedule())
    assert where == {1: ("n9", ("0", "1")), 2: ("n9", ("2",))}
    with pytest.raises(ValueError, match="already in the run"):
        policy.add_node(Node("n9", "late", cards(4), 1))


def test_a_job_too_large_for_every_node_is_skipped_before_a_larger_one_joins():
    policy = cluster(2)
    policy.submit([job(0, 4)])
    (decision,) = policy.schedule()
    assert isinstance(decision, Unschedulable)
    policy.add_node(Node("n9", "late", cards(4), 1))
    assert policy.schedule() == []
