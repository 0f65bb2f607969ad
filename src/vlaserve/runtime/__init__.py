"""Everything stateful on the device: runners, caches, memory planning."""
