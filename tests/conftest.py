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
