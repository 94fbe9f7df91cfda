"""The trainer integrations end to end (issue 27): a ``transformers.Trainer`` job and a Lightning job,
each the example's own Trainer on 2 workers under ``TorchTrainer``, rank 1 SIGKILLed mid-epoch; Ray
Train restarts the group, cf_ray restores it from memory, and the run ends bitwise equal to an
uninterrupted run of the same job (model, optimizer, LR scheduler, the trainer's progress), every
step on the same samples and every sample once per epoch. One reference fit per framework, shared
by the module."""

from __future__ import annotations

import json

import pytest
import test_engine_e2e as e2e

import cf_ray
from cf_ray import demo

import integrations_harness as harness

pytestmark = pytest.mark.slow

# 64 samples over 2 ranks, batches of 4: 8 steps per epoch, 16 in all; a checkpoint every 3 steps.
HF = {"epochs": 2, "samples": 64, "hidden": 32, "seq_len": 8, "batch_size": 4, "interval": 3}
# 96 samples over 2 ranks, batches of 8: 6 steps per epoch, 12 in all; a checkpoint every 4 steps.
LIGHTNING = {"epochs": 2, "samples": 96, "hidden": 32, "batch_size": 8, "interval": 4}


def _fit(name: str, root, loop, example: str, config: dict):
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    out = root / "out" / name
    cfg = dict(config, out_dir=str(out), scratch=str(root / "scratch"))
    result = harness.example(example).fit(loop, cfg, name=name, storage_path=str(root / "storage"))
    return result, out


@pytest.fixture(scope="module")
def hf_reference(_ray_session, tmp_path_factory):
    pytest.importorskip("transformers")
    _, out = _fit("hf_reference", tmp_path_factory.mktemp("hf_ref"), harness.hf_loop, "train_hf", HF)
    return out


@pytest.fixture(scope="module")
def lightning_reference(_ray_session, tmp_path_factory):
    pytest.importorskip("lightning")
    _, out = _fit(
        "pl_reference", tmp_path_factory.mktemp("pl_ref"), harness.lightning_loop, "train_lightning", LIGHTNING
    )
    return out


def _check_killed_run(out, reference, *, kill_at: int, restored_step: int, samples: int, epochs: int) -> None:
    assert json.load(open(out / "killed"))["step"] == kill_at
    first, second = e2e.resumes(out)
    assert first["source"] == "fresh"
    assert (second["source"], second["step"]) == ("memory", restored_step), second
    # Bitwise: model, optimizer, LR scheduler and the trainer's own progress.
    assert demo.states_equal(reference / "final_state.pt", out / "final_state.pt")
    rec = e2e.lineage(out)
    assert rec == e2e.lineage(reference)  # the same samples at every step on every rank
    e2e.assert_exactly_once(rec, samples, epochs)


def test_hf_trainer_with_a_worker_sigkilled_mid_epoch_ends_bitwise_equal(ray_cluster, hf_reference, tmp_path):
    steps_per_epoch = HF["samples"] // 2 // HF["batch_size"]
    kill_at = steps_per_epoch + 3  # mid-epoch 1; the snapshot of step 9 is the newest
    result, out = _fit("hf_killed", tmp_path, harness.hf_loop, "train_hf", dict(HF, kill_at=kill_at))
    _check_killed_run(out, hf_reference, kill_at=kill_at, restored_step=9, samples=HF["samples"], epochs=HF["epochs"])
    # The run's result is cf_ray's consolidated model, readable without the optimizer.
    assert result.checkpoint is not None and "final_" in result.checkpoint.path
    model = harness.example("train_hf").build_model(HF)
    assert cf_ray.load_into(result.checkpoint, {"model": model})


def test_lightning_with_a_worker_sigkilled_mid_epoch_ends_bitwise_equal(ray_cluster, lightning_reference, tmp_path):
    steps_per_epoch = LIGHTNING["samples"] // 2 // LIGHTNING["batch_size"]
    kill_at = steps_per_epoch + 3  # mid-epoch 1; the snapshot of step 8 is the newest
    result, out = _fit(
        "pl_killed", tmp_path, harness.lightning_loop, "train_lightning", dict(LIGHTNING, kill_at=kill_at)
    )
    _check_killed_run(
        out,
        lightning_reference,
        kill_at=kill_at,
        restored_step=8,
        samples=LIGHTNING["samples"],
        epochs=LIGHTNING["epochs"],
    )
    assert result.checkpoint is not None and "final_" in result.checkpoint.path
