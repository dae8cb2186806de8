"""The packing policy on its own: cards, jobs and completions in, decisions out."""

from gpusched.inventory import Card
from gpusched.requirements import Requirement
from gpusched.scheduling import Assignment, Job, Packer, Unschedulable, simulate

GB = 10**9


def cards(n, memory=None):
    return [Card(str(i), memory) for i in range(n)]


def job(i, gpus=0, expected=1.0, memory=None):
    return Job(i, f"test_{i}.py", Requirement(gpus, memory), expected)


def started(decisions):
    return {d.job.id: tuple(c.id for c in d.cards) for d in decisions if isinstance(d, Assignment)}


def test_largest_first_then_longest_then_file_order():
    packer = Packer(cards(4), cpu_slots=1)
    packer.submit([job(0, 1, 9.0), job(1, 2, 1.0), job(2, 2, 5.0), job(3, 1, 1.0)])
    first = started(packer.schedule())
    # Both 2-card jobs fit on 4 cards; the longer one is placed first.
    assert first == {2: ("0", "1"), 1: ("2", "3")}
    packer.complete(2)
    assert started(packer.schedule()) == {0: ("0",), 3: ("1",)}


def test_smaller_job_backfills_when_the_largest_does_not_fit():
    packer = Packer(cards(4), cpu_slots=1)
    packer.submit([job(0, 3)])
    assert started(packer.schedule()) == {0: ("0", "1", "2")}
    packer.submit([job(1, 2), job(2, 1)])
    assert started(packer.schedule()) == {2: ("3",)}
    packer.complete(0)
    assert started(packer.schedule()) == {1: ("0", "1")}


def test_no_card_is_handed_out_twice():
    packer = Packer(cards(8), cpu_slots=2)
    packer.submit([job(i, gpus) for i, gpus in enumerate([8, 4, 4, 2, 2, 1, 1, 1, 0, 0, 0])])
    busy: dict[str, int] = {}
    done = 0
    while packer.has_pending or packer.running:
        for decision in packer.schedule():
            for card in decision.cards:
                assert card.id not in busy
                busy[card.id] = decision.job.id
        finished = min(packer.running)
        for card in packer.running[finished].cards:
            del busy[card.id]
        packer.complete(finished)
        done += 1
    assert done == 11


def test_best_fit_on_memory_keeps_big_cards_free():
    inventory = [Card("0", 80 * GB), Card("1", 40 * GB), Card("2", 40 * GB), Card("3", 80 * GB)]
    packer = Packer(inventory, cpu_slots=1)
    packer.submit([job(0, 1, memory=30 * GB), job(1, 1, memory=70 * GB)])
    assert started(packer.schedule()) == {0: ("1",), 1: ("0",)}


def test_cpu_jobs_use_slots_in_parallel_with_gpu_jobs():
    packer = Packer(cards(1), cpu_slots=2)
    packer.submit([job(0), job(1), job(2), job(3, 1)])
    assert started(packer.schedule()) == {3: ("0",), 0: (), 1: ()}
    packer.complete(0)
    assert started(packer.schedule()) == {2: ()}


def test_a_job_that_can_never_fit_is_unschedulable_with_the_reason():
    inventory = [Card("0", 40 * GB), Card("1", 80 * GB)]
    packer = Packer(inventory, cpu_slots=1)
    packer.submit([job(0, 4), job(1, 2, memory=80 * GB), job(2, 1, memory=80 * GB)])
    decisions = packer.schedule()
    skipped = {d.job.id: d.reason for d in decisions if isinstance(d, Unschedulable)}
    assert skipped == {
        0: "needs 4 GPUs, 2 available",
        1: "needs 2 GPUs with >= 80GB, 1 of 2 cards have that much",
    }
    assert started(decisions) == {2: ("1",)}


def test_quarantined_card_is_never_handed_out_again():
    packer = Packer(cards(2), cpu_slots=1)
    packer.submit([job(0, 1), job(1, 2), job(2, 1)])
    assert started(packer.schedule()) == {1: ("0", "1")}
    packer.complete(1, quarantined=["1"])
    decisions = packer.schedule()
    assert started(decisions) == {0: ("0",)}
    assert [d.job.id for d in decisions if isinstance(d, Unschedulable)] == []
    packer.complete(0)
    assert started(packer.schedule()) == {2: ("0",)}


def test_quarantine_can_make_a_pending_job_unschedulable():
    packer = Packer(cards(2), cpu_slots=1)
    packer.submit([job(0, 1, expected=5), job(1, 2, expected=1)])
    assert started(packer.schedule()) == {1: ("0", "1")}
    packer.complete(1, quarantined=["0"])
    assert started(packer.schedule()) == {0: ("1",)}
    packer.submit([job(2, 2)])
    [decision] = packer.schedule()
    assert isinstance(decision, Unschedulable) and decision.reason == "needs 2 GPUs, 1 available"


def test_cancel_pending_returns_unstarted_in_file_order():
    packer = Packer(cards(1), cpu_slots=1)
    packer.submit([job(2, 1), job(0, 1), job(1, 1)])
    packer.schedule()
    assert [j.id for j in packer.cancel_pending()] == [1, 2]
    assert not packer.has_pending


def test_simulate_predicts_the_greedy_makespan():
    jobs = [job(0, 2, 4.0), job(1, 1, 3.0), job(2, 1, 1.0), job(3, 0, 2.0)]
    runs, skipped = simulate(cards(2), jobs, cpu_slots=1)
    assert skipped == []
    by_id = {run.job.id: (run.start, run.end) for run in runs}
    assert by_id == {0: (0.0, 4.0), 3: (0.0, 2.0), 1: (4.0, 7.0), 2: (4.0, 5.0)}
    assert max(run.end for run in runs) == 7.0


def test_largest_fitting_lowers_a_file_to_what_the_inventory_can_run():
    from gpusched.scheduling import largest_fitting

    levels = [Requirement(0), Requirement(2), Requirement(1, 80 * GB)]
    assert largest_fitting(levels, cards(4)) == Requirement(2)
    assert largest_fitting(levels, [Card("0", 40 * GB)]) == Requirement(0)
    assert largest_fitting(levels, [Card("0", 80 * GB)]) == Requirement(1, 80 * GB)
    assert largest_fitting([Requirement(8)], cards(2)) is None


def test_upcoming_offers_the_head_of_every_gpu_count_first():
    packer = Packer(cards(8), cpu_slots=1)
    packer.submit(
        [job(0, 8, 5.0), job(1, 8, 4.0), job(2, 4, 3.0), job(3, 1, 9.0), job(4, 1, 8.0)]
        + [job(5, 0, 9.0), job(6, 16)]
    )
    # Nothing started yet: the order reflects which job each kind of freed card goes to.
    assert [j.id for j in packer.upcoming(4)] == [0, 2, 3, 1]
    assert [j.id for j in packer.upcoming(2)] == [0, 2]
    assert [j.id for j in packer.upcoming(10)] == [0, 2, 3, 1, 4]  # no CPU job, no 16-card job
    assert packer.upcoming(0) == []


def test_upcoming_leaves_out_started_jobs():
    packer = Packer(cards(2), cpu_slots=1)
    packer.submit([job(0, 2, 5.0), job(1, 1, 4.0), job(2, 1, 3.0)])
    assert started(packer.schedule()) == {0: ("0", "1")}
    assert [j.id for j in packer.upcoming(4)] == [1, 2]
