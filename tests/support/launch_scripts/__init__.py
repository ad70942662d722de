"""Scripts that tests/e2e/test_launch.py runs under `plait run` (importable for `-m`)."""
