"""Start-up: what brings an engine from nothing to serving (its graphs planned, compiled and captured
beside serving), and is dropped once it is done. The runtime never knows it (tests/test_imports.py)."""
