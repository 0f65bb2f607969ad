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


def tiny_interpreted_model(depth: int, cameras: int, steps: int) -> str:
    """The opening of a script run under Triton's interpreter (TRITON_INTERPRET=1): a tiny Pi0.5 configuration
    `cfg` whose fast-path kernels the interpreter runs in seconds, and batch-1 inputs of its shapes: `images`
    (`cameras` 28x28 frames), `noise` [1, 50, 32], `b`, `cams`, `tokens`, `steps`, `horizon`."""
    return f"""
import json, sys, torch
from vlaserve.config import GemmaDims, ModelConfig, VisionDims
from vlaserve.demo import random_model
from vlaserve.runtime.fast import kernels
from vlaserve.runtime.fast.model import FastPi05

assert kernels.available() and kernels.interpreted()
gemma = GemmaDims(width=256, depth={depth}, mlp_dim=512, num_heads=2, num_kv_heads=1, head_dim=128, vocab_size=64)
cfg = ModelConfig(VisionDims(width=64, depth={depth}, mlp_dim=128, num_heads=2, head_dim=32, image_size=28), gemma, gemma)
torch.manual_seed(0)
b, cams, tokens, steps, horizon = 1, {cameras}, 8, {steps}, 50
images = torch.rand(b, cams, 3, 28, 28) * 2 - 1
"""
