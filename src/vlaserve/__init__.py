"""vlaserve: a fast, exact serving runtime for the Pi0.5 robot policy."""

from .errors import CheckpointError, InvalidObservation, VlaserveError
from .policy import InferenceResult, Policy

__all__ = ["Policy", "InferenceResult", "CheckpointError", "InvalidObservation", "VlaserveError"]
__version__ = "0.1.0"
