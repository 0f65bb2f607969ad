from pathlib import Path

import pytest
from tqdm.std import tqdm

from fixtures import fixture_dir

# No tqdm monitor thread in the test process: the one thread alive at interpreter exit after a full run (a daemon
# that wakes every 10 s), where one of two fresh-clone runs of the suite died with a segmentation fault after its
# summary (session 24). Progress bars are unchanged; only tqdm's check for stalled bars goes.
tqdm.monitor_interval = 0


def golden_dir() -> Path:
    return fixture_dir("pi05_golden")


@pytest.fixture(scope="session")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="session")
def golden_policy(golden):
    from vlaserve import Policy

    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes long on 2 CPU cores (servers, Ray, the Triton interpreter)")
