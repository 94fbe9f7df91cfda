"""cf_ray's own split of an ordered row stream (Ray Data under elastic_data_config): every row of an
epoch is read once across any sequence of world sizes, ranks read as many rows when ``equal``, and a
rank's rows are decided from a bounded prefix of the stream. Pure arithmetic, in process."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from cf_ray.data._row_plan import PlanOrderError, RowPlan, Split


def rows_of(runs):
    return [i for a, b in runs for i in range(a, b)]


def run_epoch(total, schedule, chunk, equal):
    """``schedule``: [(world, rows each rank consumes or None for its whole plan)]. Returns the rows
    read, in order per stage, and the last stage's plan lengths."""
    history, seen, lengths = [], [], []
    for world, take in schedule:
        consumed, lengths = [], []
        for r in range(world):
            plan = RowPlan(chunk=chunk, equal=equal, history=history, world=world, rank=r)
            n = plan.length(total, True)
            lengths.append(n)
            k = n if take is None else min(take[r] if isinstance(take, list) else take, n)
            seen += rows_of(plan.rows(0, k, total, True))
            consumed.append(k)
        history.append((world, consumed))
    return seen, lengths


SCHEDULES = {
    "one world": [(3, None)],
    "2->1": [(2, 7), (1, None)],
    "1->2": [(1, 9), (2, None)],
    "2->3->1": [(2, 5), (3, 4), (1, None)],
    "uneven 3->2": [(3, [4, 9, 0]), (2, None)],
    "4->2->4": [(4, 12), (2, 3), (4, None)],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("total, chunk", [(103, 4), (40, 5), (7, 8), (0, 3)])
def test_every_row_once_across_world_sizes(name, total, chunk):
    seen, lengths = run_epoch(total, SCHEDULES[name], chunk, equal=False)
    assert Counter(seen) == Counter(range(total))
    assert max(lengths) - min(lengths) <= 1  # balanced: at most one row apart
    seen, lengths = run_epoch(total, SCHEDULES[name], chunk, equal=True)
    assert len(set(lengths)) == 1  # every rank as many rows (so as many batches)
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(total))
    assert total - len(seen) < SCHEDULES[name][-1][0]  # dropped: fewer rows than ranks, at the end


def test_complete_rounds_are_chunks_round_robin():
    plan = [RowPlan(chunk=3, equal=True, history=[], world=2, rank=r) for r in range(2)]
    assert plan[0].rows(0, 6, 14, True) == [(0, 3), (6, 9)]
    assert plan[1].rows(0, 6, 14, True) == [(3, 6), (9, 12)]
    assert plan[0].rows(6, 7, 14, True) == [(12, 13)] and plan[1].rows(6, 7, 14, True) == [(13, 14)]
    assert plan[0].rows(1, 5, 14, True) == [(1, 3), (6, 8)]


def test_decisions_need_only_a_bounded_prefix_and_never_change():
    rnd = random.Random(3)
    for _ in range(60):
        total, chunk = rnd.randrange(0, 50), rnd.randrange(1, 6)
        worlds = [rnd.randrange(1, 5) for _ in range(rnd.randrange(1, 4))]
        history = []
        for w in worlds[:-1]:
            lens = [Split(w, chunk, False).length(r, total) for r in range(w)]  # a rough bound is enough here
            history.append((w, [rnd.randrange(0, max(1, lens[r] // 2 + 1)) for r in range(w)]))
        world = worlds[-1]
        frontier = 0  # one past the last row any old rank consumed
        try:
            for i, (w, consumed) in enumerate(history):
                for r, c in enumerate(consumed):
                    old = RowPlan(chunk=chunk, equal=False, history=history[:i], world=w, rank=r)
                    frontier = max([frontier, *(b for _, b in old.rows(0, c, total, True))])
        except PlanOrderError:
            continue
        for r in range(world):
            plan = RowPlan(chunk=chunk, equal=False, history=history, world=world, rank=r)
            try:
                n = plan.length(total, True)
            except PlanOrderError:
                break  # a history that consumed more than the stream has: refused, checked below
            full = plan.rows(0, n, total, True)
            for k in range(n):
                want = rows_of(full)[k]
                for avail in range(total + 1):  # the first prefix that decides row k
                    got = RowPlan(chunk=chunk, equal=False, history=history, world=world, rank=r).rows(
                        k, k + 1, avail, False
                    )
                    if got is not None:
                        assert rows_of(got) == [want]
                        # lookahead: one round of each stage beyond the row, or beyond what the old
                        # ranks consumed (the restart's stages are settled first)
                        assert avail <= max(want + 1, frontier) + sum(w * chunk for w in worlds)
                        break


def test_a_stream_shorter_than_what_was_consumed_is_refused():
    plan = RowPlan(chunk=2, equal=False, history=[(2, [5, 5])], world=1, rank=0)
    with pytest.raises(PlanOrderError, match="stream ended after 8 rows"):
        plan.rows(0, 1, 8, True)
    assert plan.rows(0, 1, 8, False) is None  # not ended: wait for more
