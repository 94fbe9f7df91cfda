"""``python -m benchmarks.soak``: the fault soak (``benchmarks/soak/runner.py``)."""

import sys

from benchmarks.soak.runner import main

sys.exit(main())
