"""Exceptions that cross module boundaries.

The server maps these to HTTP status codes, so every error a user can cause names the
field at fault instead of surfacing as a generic 500.
"""


class VlaserveError(Exception):
    """Base class for every error vlaserve raises on purpose."""


class ConfigError(VlaserveError, ValueError):
    """A runtime or server setting is invalid (reported at startup, before anything loads)."""


class CheckpointError(VlaserveError):
    """The checkpoint is missing, incomplete or does not match the model it claims to be."""


class InvalidInput(VlaserveError, ValueError):
    """Something a caller sent is malformed. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidObservation(InvalidInput):
    """The observation does not fit this checkpoint (cameras, image layout, state dim)."""


class InvalidRequest(InvalidInput):
    """A value or request option is malformed (types, finiteness, ranges, noise or RTC shapes)."""


class InsufficientMemory(VlaserveError):
    """The chosen memory profile will not fit the device; raised at startup, before any weight loads."""


class NonFiniteActions(VlaserveError):
    """The model produced NaN or inf actions for one request (inputs within bounds can still
    overflow, e.g. extreme RTC chunks): an error for that request, never a reply with NaN in it."""


class NotServing(VlaserveError):
    """The runtime cannot run batches: its batch-1 CUDA graphs were not captured within the wait
    bound, or the warm-up failed before them (the server log says why). A request gets this, never
    a silent fallback to another engine."""


class WeightUpdateRefused(VlaserveError):
    """A weight update (Policy.update_weights) refused before anything changed. `reason` says why, for the
    server to answer it: "not_found" (the checkpoint, or a file it needs, is missing), "mismatch" (another
    family, architecture, tensor set, shape, dtype or processor pipeline than the served one), "unreadable" (a
    malformed or truncated file), "busy" (another update is running), "unavailable" (this server cannot update
    its weights in place: still starting, fp8, offload)."""

    REASONS = ("not_found", "mismatch", "unreadable", "busy", "unavailable")

    def __init__(self, reason: str, message: str):
        if reason not in self.REASONS:
            raise ValueError(f"unknown reason {reason!r}")
        super().__init__(message)
        self.reason, self.message = reason, message
