"""Scripts that tests/test_launch.py runs under `plait run` (importable for `-m`)."""
