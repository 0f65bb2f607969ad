from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "pi05_golden"


def golden_dir() -> Path:
    if not (GOLDEN / "checkpoint" / "model.safetensors").exists():
        raise RuntimeError(
            f"golden fixtures not found at {GOLDEN}: the tests need ../shared/pi05_golden beside the checkout")
    return GOLDEN


@pytest.fixture(scope="session")
def golden() -> Path:
    return golden_dir()


@pytest.fixture(scope="session")
def golden_policy(golden):
    from vlaserve import Policy

    return Policy.from_pretrained(golden / "checkpoint", device="cpu", dtype="float32", progress=False)
