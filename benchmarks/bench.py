"""Run the cf_ray benchmark: ``python benchmarks/bench.py --quick`` (same as ``cf-ray bench --quick``).

The logic lives in :mod:`cf_ray.bench`, inside the installed package, because Ray pickles the
training loops by reference and its workers must be able to import them.
"""

import sys

from cf_ray.bench import main

if __name__ == "__main__":
    sys.exit(main())
