from pathlib import Path

import pytest

from fixtures import fixture_dir


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
