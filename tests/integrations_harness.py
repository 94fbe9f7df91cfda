"""What the trainer-integration tests run in Ray Train's workers: the examples' own Trainers
(``examples/train_hf.py``, ``examples/train_lightning.py``), plus a recorder callback that writes
which samples every step trained on (``ids_rank<r>_gen<g>.jsonl``, read by
``test_engine_e2e.lineage``), where each attempt resumed, the final state (rank 0), and SIGKILLs
one rank once at a given step, after its last snapshot reached the node's holder.

Importable by the workers: ``tests/`` is on their ``PYTHONPATH`` (``conftest.py``); the examples
are loaded from their files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example(name: str):
    """``examples/<name>.py`` as a module (loaded once per process)."""
    mod_name = f"cf_ray_example_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, os.path.join(ROOT, "examples", f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    return sys.modules[mod_name]


class _Record:
    """One rank's records of one attempt, and the SIGKILL."""

    def __init__(self, config: dict, rank: int, resume: Any) -> None:
        self.out, self.rank, self.config = config["out_dir"], rank, config
        os.makedirs(self.out, exist_ok=True)
        gen = resume.generation
        with open(f"{self.out}/resume_rank{rank}_gen{gen}.json", "w") as f:
            json.dump({"source": resume.source, "step": resume.step, "epoch": resume.epoch, "time": time.time()}, f)
        self.log = open(f"{self.out}/ids_rank{rank}_gen{gen}.jsonl", "w", buffering=1)  # a line per step

    def step(self, step: int, epoch: int, ids: list[int], checkpointer) -> None:
        self.log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")
        marker = f"{self.out}/killed"
        if (
            self.rank == self.config.get("kill_rank", 1)
            and step == self.config.get("kill_at")
            and not os.path.exists(marker)
        ):
            self.log.flush()
            checkpointer.wait_snapshot()  # the newest snapshot is in the holder: a memory restore
            with open(marker, "w") as f:
                json.dump({"step": step}, f)
            os.kill(os.getpid(), signal.SIGKILL)


def _save_final(out: str, state: dict) -> None:
    import torch

    torch.save(state, f"{out}/final_state.pt")


def hf_loop(config: dict) -> None:
    """``examples/train_hf.py``'s Trainer, recorded."""
    import ray.train
    import transformers

    ex = example("train_hf")
    trainer, cf = ex.build_trainer(config)
    rank = ray.train.get_context().get_world_rank()

    class Recorder(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.rec: _Record | None = None
            self.ids: list[int] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.rec = _Record(config, rank, cf.resume)

            def seen(_module, _args, kw):
                self.ids += kw["input_ids"][:, 0].tolist()  # the first token is the sample's id

            model.register_forward_pre_hook(seen, with_kwargs=True)

        def on_step_end(self, args, state, control, **kwargs):
            assert self.rec is not None
            ids, self.ids = self.ids, []
            self.rec.step(state.global_step, cf.checkpointer.epoch, ids, cf.checkpointer)

    trainer.add_callback(Recorder())  # after cf_ray's: its on_step_end has taken the step's snapshot
    trainer.train()
    if rank == 0:
        _save_final(
            config["out_dir"],
            {
                "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "optimizer": trainer.optimizer.state_dict(),
                "lr_scheduler": trainer.lr_scheduler.state_dict(),
                "progress": {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch},
            },
        )


def lightning_loop(config: dict) -> None:
    """``examples/train_lightning.py``'s Trainer, recorded."""
    import lightning.pytorch as pl
    import ray.train

    ex = example("train_lightning")
    trainer, model, cf = ex.build_trainer(config)
    rank = ray.train.get_context().get_world_rank()

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.rec: _Record | None = None
            self.ids: list[int] = []

        def on_train_start(self, trainer, pl_module):
            self.rec = _Record(config, rank, cf.resume)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.ids = batch[0].tolist()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert self.rec is not None
            self.rec.step(trainer.global_step, trainer.current_epoch, self.ids, cf.checkpointer)

    trainer.callbacks.append(Recorder())  # after cf_ray's
    trainer.fit(model)
    if rank == 0:
        _save_final(
            config["out_dir"],
            {
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": trainer.optimizers[0].state_dict(),
                "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "progress": {"global_step": trainer.global_step, "fit_loop": trainer.fit_loop.state_dict()},
            },
        )
