"""Fixtures of the data-source tests."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset


class IdDataset(Dataset):
    """Item ``i`` is the id ``i``: batches are tensors of ids."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


def tensor_ids(batch: torch.Tensor) -> list[int]:
    return batch.tolist()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """The session's local Ray cluster, with Ray Data's progress bars off."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")

    ctx = ray.data.DataContext.get_current()
    old = ctx.enable_progress_bars
    ctx.enable_progress_bars = False
    yield ray
    ctx.enable_progress_bars = old
