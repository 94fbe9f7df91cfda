"""The automatic interval on a real TorchTrainer run: storage that slows down half-way makes the
controller widen the interval within a few checkpoints, and shorten it again once it is fast."""

from __future__ import annotations

import json

import pyarrow.fs as pafs
import pytest

from cf_ray import demo

pytestmark = pytest.mark.slow

SLOW_FROM, SLOW_TO = 60, 220  # checkpoints of these steps take DELAY_S more per data file
DELAY_S = 0.3  # x 3 data files (shared, rank 0, rank 1): ~1 s per checkpoint, ~25 iterations
# The holder writes one of the slow checkpoints per ~1 s and skips the snapshots in between, so the
# policy hears of the slow storage once per ~25 steps; two such commits make a change of level.
# 160 slow steps give it five or six (100 were sometimes too few for the widening to be adopted
# before the storage was fast again).


def test_interval_widens_while_storage_is_slow_and_shortens_after(ray_cluster, tmp_path):
    from faulty_fs import SlowHandler

    fs = pafs.PyFileSystem(SlowHandler(SLOW_FROM, SLOW_TO, DELAY_S))
    # 4000 samples, 2 ranks, batches of 8: 250 steps per epoch, 750 in all, ~35 ms each. After the
    # slow phase the interval comes back in 100-280 steps (a change of level seen over two
    # checkpoints at ~29 steps, often a probe window of ~90 steps without checkpoints, then a
    # shortening confirmed at the next checkpoint; more under load): two epochs left it 280 steps
    # and a CI run ran out of them; three leave 530.
    cfg = dict(
        samples=4000,
        epochs=3,
        batch_size=8,
        hidden=64,
        depth=2,
        policy="adaptive",
        budget_pct=5.0,
        step_sleep=0.03,
        keep_last=2,
        storage_path=str(tmp_path / "ckpts"),
        storage_filesystem=fs,
    )
    demo.run("adaptive", str(tmp_path), cfg)
    result = json.load(open(tmp_path / "out" / "adaptive" / "result.json"))
    changes = [(e["previous"], e["interval"]) for e in result["events"] if e["event"] == "interval"]
    rows = sorted(result["profile"], key=lambda r: r["step"])
    at = [(r["step"], r["interval"]) for r in rows if r.get("interval")]
    before = [k for s, k in at if 20 <= s < SLOW_FROM]
    during = [k for s, k in at if SLOW_FROM <= s < SLOW_TO + 40]
    after = [k for s, k in at if s >= SLOW_TO + 60]
    assert before and during and after, at
    # Tuned before the slow phase: frequent checkpoints (a small model, fast storage). The interval
    # in force when the slow phase begins counts, not the first ones: the provisional interval
    # after the first checkpoint errs wide by design (3 to 59 in the runs seen) and may still be in force after
    # step 20 (a CI run took its checkpoint at 33 with a provisional 18, then tuned to 3).
    tuned = before[-1]
    assert tuned <= 12, (at, changes)
    # Slow storage: a persist takes ~1 s, ~26 steps of ~35 ms; one in flight at a time means the
    # interval widens to about that (28-30 in every run seen), whatever it was before (2-10).
    assert max(during) >= 20 and max(during) >= 2 * tuned, (at, changes)
    # Snapshots that storage could not keep up with were skipped whole: the slow phase committed.
    assert any(r["committed"] for r in rows if SLOW_FROM <= r["step"] < SLOW_TO), at
    # Fast again: the interval comes back down. (Not necessarily to stay: later measurements,
    # e.g. a GC pause or the final checkpoint, may widen it again on their own merits.)
    assert min(after) <= max(during) / 2, (at, changes)
    assert all(e["why"]["reason"] for e in result["events"] if e["event"] == "interval")
    # The CPU of the ranks' copies and of the holder's writes, and the idle cores, reach the policy
    # from a real run (this job sleeps in its steps: the cores are idle, so it takes nothing).
    taken = [e["why"].get("cpu_taken_s") for e in result["events"] if e["event"] == "interval"]
    assert any(isinstance(v, float) for v in taken), taken
