"""Which device and dtype a runtime uses, resolved once from RuntimeConfig's names."""

from __future__ import annotations

import torch

from ..errors import CheckpointError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device 'cuda' requested but no CUDA device is available (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CheckpointError(f"device {device} requested but only {torch.cuda.device_count()} CUDA devices exist")
    return device


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA; float32 on the CPU, where bf16 matmuls are ~4x slower."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finish_queued(device: torch.device) -> None:
    """Waits for the work this thread queued on `device` (its current stream, and what that stream waits for).
    Unlike `synchronize`, safe while another thread records a CUDA graph (the device-wide wait is not)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
