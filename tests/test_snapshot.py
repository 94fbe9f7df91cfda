"""Phase 1 on its own (no Ray): the snapshot holds the state as it was at the checkpoint step, the
weight-update guard makes the background copy safe, and buffers prepared ahead are the ones used."""

from __future__ import annotations

import numpy as np
import torch

from cf_ray._engine.format.sections import Section, parse_index
from cf_ray._engine.node.slot_store import SlotStore
from cf_ray._engine.worker.snapshot.snapshotter import Snapshotter


class _Received:
    """A hand-off that keeps a copy of what it was given; its slots are a holder's (``SlotStore``)."""

    def __init__(self):
        self.jobs: dict[int, dict] = {}
        self.arena_ptrs: dict[int, dict[str, int]] = {}
        self.store = SlotStore("test")
        self.arena = self.store.arena

    def __call__(self, job, sections):
        self.arena_ptrs[job.step] = {n: s.arena.ctypes.data for n, s in sections.items()}
        self.jobs[job.step] = {n: (s.arena.copy(), s.index) for n, s in sections.items()}

    def tree(self, step: int, name: str = "s"):
        buf, index = self.jobs[step][name]
        tree, entries = parse_index(index, "test")
        return Section(tree, entries, buf).materialize(copy=True)


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)

    def train_step(snap: Snapshotter | None = None):
        model(x).square().mean().backward()
        if snap is not None:
            snap.wait_copy()  # the guard: the copy of the previous snapshot is done before weights change
        opt.step()
        opt.zero_grad()

    def sections():
        return {"s": {"model": model.state_dict(), "opt": opt.state_dict(), "n": np.arange(5)}}

    def guarded(t):
        ptrs = {p.data_ptr() for p in model.parameters()}
        ptrs |= {v.data_ptr() for st in opt.state.values() for v in st.values() if v.dim() > 0}
        return t.data_ptr() in ptrs

    return model, opt, train_step, sections, guarded


def _equal_trees(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_trees(x, y) for x, y in zip(a, b))
    return a == b


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def test_snapshot_is_the_state_at_its_step_although_training_goes_on_during_the_copy():
    model, opt, train_step, sections, guarded = _job()
    got = _Received()
    snap = Snapshotter(0, got, arena_source=got.arena)
    train_step()
    expected = {}
    for step in range(1, 4):
        expected[step] = _clone(sections()["s"])
        snap.begin(step, sections(), guarded, {})
        train_step(snap)  # the next iteration runs while the background thread copies
        train_step(snap)
    snap.close()
    assert snap.take_errors() == []
    for step in range(1, 4):
        assert _equal_trees(got.tree(step), expected[step]), step
    assert not _equal_trees(got.tree(3)["model"], model.state_dict())  # training did go on


def test_prepared_buffers_are_the_ones_the_first_snapshot_copies_into():
    model, opt, train_step, sections, guarded = _job()
    got = _Received()
    snap = Snapshotter(0, got, arena_source=got.arena)
    train_step()  # Adam creates its state here: the layout is final
    assert snap.prepare(sections()) is True
    assert snap.wait_done(timeout=30)
    assert snap.prepare_s is not None
    prepared = snap.arenas.of("s").tensor.data_ptr()
    assert snap.prepare(sections()) is False  # buffers exist: nothing to do
    train_step(snap)
    expected = _clone(sections()["s"])
    snap.begin(2, sections(), guarded, {})
    train_step(snap)
    snap.close()
    assert got.arena_ptrs[2]["s"] == prepared
    assert _equal_trees(got.tree(2), expected)


def test_a_layout_that_changed_after_prepare_gets_new_buffers_and_a_correct_snapshot():
    model, opt, train_step, sections, guarded = _job()
    got = _Received()
    snap = Snapshotter(0, got, arena_source=got.arena)
    assert snap.prepare(sections())  # before the first optimizer step: Adam has no state yet
    assert snap.wait_done(timeout=30)
    small = snap.arenas.of("s").nbytes
    train_step(snap)
    expected = _clone(sections()["s"])
    snap.begin(1, sections(), guarded, {})
    train_step(snap)
    snap.close()
    assert snap.arenas.of("s").nbytes > small
    assert _equal_trees(got.tree(1), expected)
