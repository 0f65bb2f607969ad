"""Exceptions that cross module boundaries.

The server maps these to HTTP status codes, so every error a user can cause names the
field at fault instead of surfacing as a generic 500.
"""


class VlaserveError(Exception):
    """Base class for every error vlaserve raises on purpose."""


class CheckpointError(VlaserveError):
    """The checkpoint is missing, incomplete or does not match the model it claims to be."""


class InvalidObservation(VlaserveError, ValueError):
    """An observation (or a request option) is malformed. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InsufficientMemory(VlaserveError):
    """The chosen memory profile will not fit the device; raised at startup, before any weight loads."""


class NonFiniteActions(VlaserveError):
    """The model produced NaN or inf actions for one request (inputs within bounds can still
    overflow, e.g. extreme RTC chunks): an error for that request, never a reply with NaN in it."""
