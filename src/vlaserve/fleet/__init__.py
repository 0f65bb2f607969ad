"""A fleet of vlaserve replicas on Ray Serve (`vlaserve serve-ray`; docs/ray.md).

Ray is an optional extra (`pip install -e ".[ray]"` in the clone): only fleet.replica and fleet.command's
run path import it, so `vlaserve serve` never does."""
