"""Bad input: a clear error naming what to change, raised before any training happens."""

import pytest
import torch

import cf_ray
from cf_ray import ConfigError
from cf_ray.config import DurabilityTimeout, Replication


def _tracked():
    model = torch.nn.Linear(2, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_public_names_import():
    for name in cf_ray.__all__:
        assert getattr(cf_ray, name) is not None, name


def test_no_tracked_objects(tmp_path):
    with pytest.raises(ConfigError, match="at least one tracked object"):
        cf_ray.Checkpointer({}, config=cf_ray.CheckpointConfig(storage_path=str(tmp_path), run_name="r"))


def test_object_without_state_dict(tmp_path):
    with pytest.raises(ConfigError, match=r"'weights'.*no state_dict"):
        cf_ray.Checkpointer(
            {"weights": [1.0, 2.0]}, config=cf_ray.CheckpointConfig(storage_path=str(tmp_path), run_name="r")
        )


def test_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        cf_ray.Checkpointer(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("every", [0, -3, 2.5])
def test_bad_interval(every):
    with pytest.raises(ConfigError, match="FixedInterval.every"):
        cf_ray.FixedInterval(every=every)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"keep_last": 0}, "keep_last"),
        ({"replication": 1}, "replication"),
        ({"allow_mismatch": {"extra"}}, "allow_mismatch"),
        ({"allow_mismatch": 3}, "allow_mismatch"),
        ({"durability_timeout": -1}, "durability_timeout"),
        ({"restore_from": "disk"}, "restore_from"),
        ({"milestone_every": -1}, "milestone_every"),
        ({"policy": 10}, "policy"),
        ({"upload": "some"}, "upload"),
        ({"policy": cf_ray.Adaptive}, "policy"),
        ({"policy": cf_ray.FixedInterval}, "policy"),
        ({"freeze_gc": "yes"}, "freeze_gc"),
    ],
)
def test_bad_config_fields(kwargs, field):
    with pytest.raises(ConfigError, match=f"CheckpointConfig.{field}"):
        cf_ray.CheckpointConfig(**kwargs)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Replication(copies=-1), "Replication.copies"),
        (lambda: Replication(copies=True), "Replication.copies"),
        (lambda: Replication(label=""), "Replication.label"),
        (lambda: Replication(every=0), "Replication.every"),
        (lambda: Replication(every=2.0), "Replication.every"),
        (lambda: Replication(every=True), "Replication.every"),
        (lambda: DurabilityTimeout(seconds=0), "DurabilityTimeout.seconds"),
        (lambda: DurabilityTimeout(factor=0.5), "DurabilityTimeout.factor"),
        (lambda: DurabilityTimeout(floor_s=-1), "DurabilityTimeout.floor_s"),
    ],
)
def test_bad_grouped_settings(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_grouped_settings_travel_together_and_take_their_short_forms():
    c = cf_ray.CheckpointConfig(
        replication=Replication(copies=1, label="pool", every=4),
        durability_timeout=20,
        allow_mismatch="missing",
    )
    assert c.replication == Replication(copies=1, label="pool", every=4)
    assert c.durability_timeout == DurabilityTimeout(seconds=20.0)
    assert c.allow_mismatch == frozenset({"missing"})
    d = cf_ray.CheckpointConfig()
    assert d.replication == Replication() and d.durability_timeout == DurabilityTimeout()
    assert d.allow_mismatch == frozenset()
    assert cf_ray.config.Replication is Replication  # an attribute after import cf_ray alone


def test_unwritable_storage_path_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="not writable.*storage_path"):
        cf_ray.Checkpointer(_tracked(), config=cf_ray.CheckpointConfig(storage_path=str(blocker / "sub"), run_name="r"))


def test_outside_ray_train_run_name_and_storage_are_required(tmp_path):
    with pytest.raises(ConfigError, match="run_name"):
        cf_ray.Checkpointer(_tracked(), config=cf_ray.CheckpointConfig(storage_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="storage_path"):
        cf_ray.Checkpointer(_tracked(), config=cf_ray.CheckpointConfig(run_name="r"))
