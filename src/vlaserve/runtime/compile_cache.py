"""The persistent compile cache: where Triton keeps the fast path's compiled kernels between starts.

A start with a warm cache loads each kernel's binary instead of compiling it. Triton already keys each
entry by its source, options and target architecture; the directory here adds the GPU's name and
compute capability, the CUDA runtime, torch, Triton and vlaserve versions, so an upgrade or another
GPU starts in a fresh subdirectory instead of mixing with (or tripping over) the old entries, and an
old one can be deleted as a whole.

Replicas on one node share a directory safely: Triton writes each file into a temporary directory of
its own (named after the process and a random id) and moves it into place with os.replace, which is
atomic on POSIX, so a reader sees a whole file or none (triton/runtime/cache.py, FileCacheManager.put).
"""

from __future__ import annotations

import logging
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..about import __version__
from ..errors import ConfigError

log = logging.getLogger(__name__)

TRITON_ENV = "TRITON_CACHE_DIR"  # Triton reads it each time it opens its cache, so setting it before the first compile is enough
_activated: str | None = None  # the TRITON_CACHE_DIR this module set: not the user's choice


def default_directory() -> Path:
    """$XDG_CACHE_HOME/vlaserve/compile, or ~/.cache/vlaserve/compile (the XDG default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlaserve" / "compile"


def _triton_version() -> str:
    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def cache_key(device: torch.device) -> str:
    """The subdirectory for this device and software, readable: e.g.
    NVIDIA-H200-sm90-cuda12.8-torch2.11.0-cu128-triton3.6.0-vlaserve0.1.0."""
    major, minor = torch.cuda.get_device_capability(device)
    parts = (torch.cuda.get_device_name(device), f"sm{major}{minor}", f"cuda{torch.version.cuda}",
             f"torch{torch.__version__}", f"triton{_triton_version()}", f"vlaserve{__version__}")
    return re.sub(r"[^A-Za-z0-9._]+", "-", "-".join(parts)).strip("-")


def activate(directory: str | Path | None, device: torch.device) -> Path:
    """Points Triton's cache at `directory`/<cache_key> (created) and returns that path; call it before
    any kernel compiles. `directory` None: a TRITON_CACHE_DIR the user set is kept as it is, else the
    default directory is used. A directory given wins over the environment (the log says so)."""
    global _activated
    users = os.environ.get(TRITON_ENV)
    users = None if users == _activated else users
    keep = directory is None and bool(users)
    path = Path(users) if keep else Path(directory or default_directory()).expanduser() / cache_key(device)
    if keep:
        log.info("compile cache: %s (%s set in the environment; --compile-cache overrides it)", path, TRITON_ENV)
    elif users:
        log.info("compile cache: %s (--compile-cache given: %s=%s ignored)", path, TRITON_ENV, users)
    else:
        log.info("compile cache: %s", path)
    try:
        path.mkdir(parents=True, exist_ok=True)  # concurrent replicas: exist_ok
    except OSError as e:
        raise ConfigError(f"cannot create the compile cache {path}: {e.strerror}; pass --compile-cache DIR "
                          f"(a writable directory)") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"the compile cache {path} is not writable; pass --compile-cache DIR (a writable directory)")
    if not keep:
        _activated = os.environ[TRITON_ENV] = str(path)
    return path


def is_empty(path: Path) -> bool:
    """Whether the cache directory `activate` returned holds nothing yet (a first start for this GPU
    and software: every kernel will compile)."""
    return not any(Path(path).iterdir())
