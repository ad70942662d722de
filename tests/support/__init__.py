"""Harnesses and helpers the tests share, imported as `support.X` (tests/ is on the path)."""
