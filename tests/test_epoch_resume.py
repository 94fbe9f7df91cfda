"""The README's scheduler pattern resumes bitwise at an epoch's end (#23, item 8 of the issue).

Both habits in one loop: a per-iteration scheduler stepped right after ``ckpt.step()`` and a
per-epoch one stepped after the epoch's last ``ckpt.step()``, before ``ckpt.end_epoch()``. Every
checkpoint falls on an epoch's last step (6 steps per epoch, a checkpoint every 6): its late state is
taken at ``end_epoch()``, so it already holds the epoch's scheduler step, and it resumes at the next
epoch. One chain of Checkpointers (a Checkpointer with Ray actors in this process, ``close()`` for a
worker that dies) restores from memory, from storage, after the run's actors are gone (what a new
driver sees: a controller rebuilt from storage only), and then a new run continues from
``resume_from=<the final model>``; each stage compares with one uninterrupted run, bitwise.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

import cf_ray
from cf_ray.data import ResumableDistributedSampler

pytestmark = pytest.mark.slow

SAMPLES, BATCH = 24, 4  # one rank: 6 steps per epoch
PER_EPOCH = SAMPLES // BATCH


class _Run:
    """The tracked objects and the data of one process of the run."""

    def __init__(self):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 3, generator=g), torch.randn(SAMPLES, 1, generator=g)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5, momentum=0.9)
        self.per_iter = torch.optim.lr_scheduler.MultiplicativeLR(self.opt, lambda _: 0.97)
        self.per_epoch = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        self.sampler = ResumableDistributedSampler(list(range(SAMPLES)), rank=0, world_size=1, shuffle=True, seed=0)
        self.loader = torch.utils.data.DataLoader(cast(Any, range(SAMPLES)), batch_size=BATCH, sampler=self.sampler)
        self.step = 0

    def checkpointer(self, tmp_path, name, **cfg) -> cf_ray.Checkpointer:
        return cf_ray.Checkpointer(
            {"model": self.model, "optimizer": self.opt, "per_iter": self.per_iter, "per_epoch": self.per_epoch},
            data={"sampler": self.sampler},
            config=cf_ray.CheckpointConfig(
                storage_path=str(tmp_path),
                run_name=name,
                register_with_ray=False,
                preemption=False,
                policy=cf_ray.FixedInterval(every=PER_EPOCH),
                **cfg,
            ),
        )

    def train(self, ck, first_epoch: int, epochs: int, stop_at: int | None = None) -> bool:
        """The README's loop; returns False when it stopped at ``stop_at`` (the worker dies there)."""
        for epoch in range(first_epoch, epochs):
            self.sampler.set_epoch(epoch)
            for ids in self.loader:
                torch.nn.functional.mse_loss(self.model(self.x[ids]), self.y[ids]).backward()
                if ck is not None:
                    ck.step(self.opt)
                    self.step = ck.step_count
                else:
                    self.opt.step()
                    self.step += 1
                self.opt.zero_grad()
                self.per_iter.step()  # per iteration, after ckpt.step()
                if self.step == stop_at:
                    return False
            self.per_epoch.step()  # per epoch, before ckpt.end_epoch()
            if ck is not None:
                ck.end_epoch()
        return True

    def state(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "momentum": [s["momentum_buffer"].clone() for s in self.opt.state.values()],
            "lr": self.opt.param_groups[0]["lr"],
            "per_iter": self.per_iter.last_epoch,
            "per_epoch": self.per_epoch.last_epoch,
        }


def _equal(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
        and all(torch.equal(x, y) for x, y in zip(a["momentum"], b["momentum"]))
        and (a["lr"], a["per_iter"], a["per_epoch"]) == (b["lr"], b["per_iter"], b["per_epoch"])
    )


def _resume(run: _Run, ck: cf_ray.Checkpointer, source: str, step: int, epoch: int) -> cf_ray.Resume:
    resume = ck.restore()
    assert (resume.source, resume.step, resume.epoch) == (source, step, epoch), resume
    assert run.per_epoch.last_epoch == epoch  # the epoch's scheduler step is in, once
    run.step = resume.step
    return resume


def test_both_scheduler_habits_resume_bitwise_from_a_checkpoint_on_an_epochs_last_step(ray_cluster, tmp_path):
    import ray

    reference = _Run()
    reference.train(None, 0, 3)
    at_18 = reference.state()
    reference.train(None, 3, 4)
    at_24 = reference.state()

    a = _Run()  # the first worker: dies at step 8, in epoch 1 (its checkpoint: step 6, epoch 0's last)
    ck = a.checkpointer(tmp_path, "epochs")
    ck.restore()
    assert not a.train(ck, 0, 3, stop_at=8)
    ck.wait()
    ck.close()

    b = _Run()  # restarted: from the holder's memory
    ck = b.checkpointer(tmp_path, "epochs", restore_from="memory")
    resume = _resume(b, ck, "memory", 6, 1)
    assert not b.train(ck, resume.epoch, 3, stop_at=14)  # dies in epoch 2 (checkpoint: step 12)
    ck.wait()
    ck.close()

    c = _Run()  # restarted: from storage
    ck = c.checkpointer(tmp_path, "epochs", restore_from="storage")
    resume = _resume(c, ck, "storage", 12, 2)
    assert not c.train(ck, resume.epoch, 3, stop_at=16)
    ck.wait()
    for actor in (ck.holder, ck.controller):  # the driver and its cluster's actors are gone
        ray.kill(actor, no_restart=True)
    ck.close()

    d = _Run()  # the script again: a controller rebuilt from storage only
    ck = d.checkpointer(tmp_path, "epochs")
    resume = _resume(d, ck, "storage", 12, 2)
    assert d.train(ck, resume.epoch, 3)
    summary = ck.finish()  # the last scheduled checkpoint is step 18, epoch 2's last: no other is taken
    assert _equal(d.state(), at_18)
    assert summary.committed_steps[-1] == 18 and summary.resume_step == 18 and summary.final_path

    e = _Run()  # a new run from the result
    ck = e.checkpointer(tmp_path, "epochs_more", resume_from=summary.final_path)
    resume = _resume(e, ck, "storage", 18, 3)
    assert e.train(ck, resume.epoch, 4)
    ck.finish()
    assert _equal(e.state(), at_24)
