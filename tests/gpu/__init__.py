"""GPU tier: multi-process tests, one process per GPU (see harness.py)."""
