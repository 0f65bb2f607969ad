"""The repository's golden fixtures (stdlib only: the GPU benches use it too)."""

import hashlib
import shutil
import tarfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
UNPACKED = DATA / ".unpacked"  # ignored by git; refilled whenever an archive changes


def fixture_dir(name: str) -> Path:
    """The golden fixture set `name` (tests/data/NAME.tar.xz, made by LeRobot 0.6.1; see
    tests/data/README.md), unpacked once into tests/data/.unpacked/NAME."""
    archive = DATA / f"{name}.tar.xz"
    if not archive.exists():
        raise RuntimeError(f"golden fixture archive {archive} is missing from the checkout")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    target, stamp = UNPACKED / name, UNPACKED / f"{name}.sha256"
    if not (stamp.exists() and stamp.read_text() == digest and target.is_dir()):
        staging = UNPACKED / f".{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(staging, filter="data")
        (staging / name).rename(target)
        staging.rmdir()
        stamp.write_text(digest)
    return target
