"""Apply trained networks (docs/inference.md)."""
