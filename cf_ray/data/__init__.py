"""Exactly-once, resumable data for every source cf_ray supports.

Every source records what the training loop has *consumed* (never what a prefetcher read ahead)
in a small JSON-able ``state_dict()``, orders each epoch as a pure function of ``(seed, epoch)``,
and follows the same epoch rules (see :mod:`cf_ray.data.protocols`). Give the objects to
``cf_ray.Checkpointer(data={...})``; they are per rank.

=====================================  ======================================  ===============
Source                                 Class                                   Elastic resume
=====================================  ======================================  ===============
map-style dataset, ``DataLoader``      :class:`ResumableDistributedSampler`,    yes
                                       :class:`ResumableDataLoader`
dataset too large for one worker       :class:`ShardedDataset`                  yes
Ray Data (``get_dataset_shard``)       :class:`ResumableRayDataIterator`        at epoch ends;
                                                                               yes under
                                                                               :func:`elastic_data_config`
Parquet files (pyarrow)                :class:`ResumableParquetReader`          yes
NVIDIA DALI                            :class:`DALIExternalSource`,             yes
                                       :class:`ResumableDALIIterator`
torchdata ``StatefulDataLoader``       the loader itself (wrapped in            at epoch ends
                                       :class:`StatefulDataLoaderSource`)
=====================================  ======================================  ===============
"""

from cf_ray.data.dali import DALIExternalSource, ResumableDALIIterator
from cf_ray.data.loader import ResumableDataLoader
from cf_ray.data.parquet import ResumableParquetReader
from cf_ray.data.protocols import DataOrderError, ElasticStateful, Stateful
from cf_ray.data.ray_data import ResumableRayDataIterator, ordered_data_config
from cf_ray.data.ray_elastic import elastic_data_config
from cf_ray.data.sampler import ResumableDistributedSampler, ResumableSampler
from cf_ray.data.sharded import ShardedDataset
from cf_ray.data.stateful_loader import StatefulDataLoaderSource

__all__ = [
    "DALIExternalSource",
    "DataOrderError",
    "ElasticStateful",
    "ResumableDALIIterator",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "ResumableParquetReader",
    "ResumableRayDataIterator",
    "ResumableSampler",
    "ShardedDataset",
    "Stateful",
    "StatefulDataLoaderSource",
    "elastic_data_config",
    "ordered_data_config",
]
