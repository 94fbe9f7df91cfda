"""The engine's side of the data sources (no torch here):

* ``block_stream.py``: the Ray Data side of cf_ray's elastic split, the ``DataConfig`` Ray Train
  calls for every worker group and the per-group actor that runs the pipeline once per epoch (both
  run in Ray Train's and Ray Data's own processes);
* ``cursor.py`` and ``checks.py``: the position machinery and the state checks the sources of
  :mod:`cf_ray.data` share, here so that a restore can validate a source's saved state without
  importing the public package."""
