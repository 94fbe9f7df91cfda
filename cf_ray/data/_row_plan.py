"""Which rows of an epoch each rank reads when cf_ray splits an ordered row stream itself (Ray Data
under :func:`cf_ray.data.elastic_data_config`). Pure arithmetic: no Ray, no data.

The rows of an epoch are numbered in stream order (global positions ``0 .. T-1``; ``T`` is known
only when the stream ends). A :class:`Split` of ``world`` ranks cuts its input sequence into
*chunks* of ``chunk`` rows and *rounds* of ``world`` chunks; in every complete round rank ``r``
reads chunk ``r``. The last, incomplete round (``t < world * chunk`` rows) is shared evenly: each
rank reads ``t // world`` contiguous rows of it, and the ``t % world`` left over go one each to the
first ranks (``equal=False``) or are dropped (``equal=True``: every rank reads as many rows, as
Ray's ``streaming_split(equal=True)`` does, so every rank has as many batches). A rank's plan is
therefore a closed-form function of ``(T, world, chunk, equal)``, and deciding where a row goes
needs at most one round of lookahead.

An elastic restart mid-epoch records a *history*: the world size and the rows each old rank had
consumed (a prefix of its plan). The next split's input is every position of the previous input
that no old rank consumed, in order (rows the previous split would have dropped included), and so
on for several restarts. The rows an epoch ever reads are thus each read once, whatever the world
sizes; the block boundaries of the stream play no part, so a pipeline may produce other blocks in
the new run as long as it produces the same rows in the same order.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

Runs = list[tuple[int, int]]
"""Half-open ranges of positions, sorted and disjoint."""


class PlanOrderError(ValueError):
    """The stream ended before the old ranks' consumed rows: the data changed."""


@dataclass(frozen=True, slots=True)
class Split:
    """One world size's split of an input sequence (see the module docstring)."""

    world: int
    chunk: int
    equal: bool

    def _tail(self, rank: int, total: int) -> tuple[int, int]:
        """``(start position, rows)`` of ``rank``'s share of the incomplete last round."""
        full = total // (self.world * self.chunk) * self.world * self.chunk
        base, extra = divmod(total - full, self.world)
        if self.equal:
            return full + rank * base, base
        return full + rank * base + min(rank, extra), base + (1 if rank < extra else 0)

    def length(self, rank: int, total: int) -> int:
        """Rows of ``rank``'s plan when the input has ``total`` rows."""
        return total // (self.world * self.chunk) * self.chunk + self._tail(rank, total)[1]

    def runs(self, rank: int, k0: int, k1: int, avail: int, ended: bool) -> Runs | None:
        """Input positions of ``rank``'s plan rows ``[k0, k1)``, given that ``avail`` input rows are
        known (all of them when ``ended``); None when that is not enough to tell yet.

        Raises:
            PlanOrderError: the input ended and the plan has fewer than ``k1`` rows.
        """
        out: Runs = []
        size = self.world * self.chunk
        k = k0
        while k < k1:
            q = k // self.chunk
            if (q + 1) * size <= avail:  # a complete round: the rank's chunk of it
                o = k - q * self.chunk
                n = min(k1 - k, self.chunk - o)
                p = q * size + rank * self.chunk + o
                _append(out, p, p + n)
                k += n
                continue
            if not ended:
                return None
            start, rows = self._tail(rank, avail)
            j = k - avail // size * self.chunk
            if j < 0 or j + (k1 - k) > rows:
                raise PlanOrderError(
                    f"rank {rank} of {self.world}: rows [{k0}, {k1}) of its plan, but the stream ended after "
                    f"{avail} rows, which give it {self.length(rank, avail)}"
                )
            _append(out, start + j, start + j + (k1 - k))
            k = k1
        return out


def _append(runs: Runs, a: int, b: int) -> None:
    if a >= b:
        return
    if runs and runs[-1][1] == a:
        runs[-1] = (runs[-1][0], b)
    else:
        runs.append((a, b))


def _merge(runs: list[tuple[int, int]]) -> Runs:
    out: Runs = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return out


class _Gaps:
    """The positions one history stage consumed, and the mapping of the next stage's positions
    (the unconsumed ones, renumbered) back to this stage's."""

    def __init__(self, consumed: Runs) -> None:
        self.total = sum(b - a for a, b in consumed)
        # Kept intervals [lo, hi) of this stage's positions (the last one open-ended) and the
        # next stage's position each starts at.
        self.lo: list[int] = []
        self.starts: list[int] = []
        pos = nxt = 0
        for a, b in consumed:
            if a > pos:
                self.lo.append(pos)
                self.starts.append(nxt)
                nxt += a - pos
            pos = b
        self.lo.append(pos)
        self.starts.append(nxt)

    def back(self, runs: Runs) -> Runs:
        """Positions of the previous stage for ``runs`` of the next stage's positions."""
        out: Runs = []
        for a, b in runs:
            i = bisect.bisect_right(self.starts, a) - 1
            while a < b:
                lo, start = self.lo[i], self.starts[i]
                end = self.starts[i + 1] if i + 1 < len(self.starts) else b
                n = min(b, end) - a
                _append(out, lo + (a - start), lo + (a - start) + n)
                a += n
                i += 1
        return out


class RowPlan:
    """The plan of ``rank`` of ``world`` for one epoch after ``history`` (see the module docstring).

    Args:
        chunk: rows per chunk (the same in every stage: a setting of the run).
        equal: drop the remainder of the last round so every rank reads as many rows.
        history: earlier stages of this epoch: ``[(world size, [rows consumed per old rank])]``.
        world: this stage's world size.
        rank: this rank.
    """

    def __init__(
        self, *, chunk: int, equal: bool, history: Sequence[tuple[int, Sequence[int]]], world: int, rank: int
    ) -> None:
        self.stages = [(Split(w, chunk, equal), list(c)) for w, c in history]
        self.split = Split(world, chunk, equal)
        self.rank = rank
        self._gaps: list[_Gaps] = []

    def _settle(self, avail: int, ended: bool) -> int | None:
        """Work out the history stages' gaps as far as ``avail`` allows; return this stage's known
        input rows, or None while a history stage cannot be settled yet."""
        for i, (split, consumed) in enumerate(self.stages):
            if i < len(self._gaps):
                avail -= self._gaps[i].total
                continue
            runs: list[tuple[int, int]] = []
            for r, c in enumerate(consumed):
                got = split.runs(r, 0, c, avail, ended)
                if got is None:
                    return None
                runs += got
            self._gaps.append(_Gaps(_merge(runs)))
            avail -= self._gaps[i].total
        return avail

    def length(self, avail: int, ended: bool) -> int | None:
        """Rows of this rank's plan, once the stream has ended (None before)."""
        mine = self._settle(avail, ended)
        if mine is None or not ended:
            return None
        return self.split.length(self.rank, mine)

    def rows(self, k0: int, k1: int, avail: int, ended: bool) -> Runs | None:
        """Global positions of this rank's plan rows ``[k0, k1)`` (None: more of the stream is needed)."""
        mine = self._settle(avail, ended)
        if mine is None:
            return None
        runs = self.split.runs(self.rank, k0, k1, mine, ended)
        if runs is None:
            return None
        for gaps in reversed(self._gaps):
            runs = gaps.back(runs)
        return runs

    def stretch(self, k: int) -> int:
        """Plan rows from ``k`` to the end of its chunk: the most one contiguous request may span."""
        return self.split.chunk - k % self.split.chunk
