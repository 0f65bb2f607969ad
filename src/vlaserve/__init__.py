"""vlaserve: a fast, exact serving runtime for the Pi0.5 robot policy."""

from .about import STARTED, __version__
from .errors import CheckpointError, InvalidObservation, VlaserveError

__all__ = ["Policy", "InferenceResult", "CheckpointError", "InvalidObservation", "VlaserveError", "STARTED",
           "__version__"]


def __getattr__(name: str):
    # Policy pulls in torch (~5 s on a GPU machine); importing it lazily lets `vlaserve serve` start
    # reading the checkpoint (vlaserve.files) before that import.
    if name in ("Policy", "InferenceResult"):
        from . import policy

        return getattr(policy, name)
    raise AttributeError(f"module 'vlaserve' has no attribute {name!r}")
