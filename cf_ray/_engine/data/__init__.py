"""The Ray Data side of cf_ray's elastic split: the ``DataConfig`` Ray Train calls for every worker
group and the per-group actor that runs the pipeline once per epoch (no torch here: both run in Ray
Train's and Ray Data's own processes)."""
