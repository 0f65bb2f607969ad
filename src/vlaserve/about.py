"""The package's version and when this process began loading it: a leaf module, so any module may
import these without importing the package's __init__ (which reaches policy.py)."""

import time

__version__ = "0.1.0"
# When this process began loading vlaserve (the `vlaserve` command imports it first, before torch): the
# start that /metrics' vlaserve_first_action_seconds counts from.
STARTED = time.perf_counter()
