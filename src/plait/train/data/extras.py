"""Finding data that optional dependencies ship, without importing them (imports are slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from plait.train.errors import MissingExtraError

DIGITS_INSTALL = "pip install 'plait[digits]'"


def digits_csv() -> Path:
    """The path of scikit-learn's bundled 8x8 digits file (`digits.csv.gz`).

    Raises:
        MissingExtraError: scikit-learn is not installed (the message has the pip command).
    """
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):  # ValueError: sys.modules["sklearn"] is None
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in locations:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    why = "is not installed" if spec is None else "has no datasets/data/digits.csv.gz"
    raise MissingExtraError(
        f"data 'digits' reads the 8x8 digits that scikit-learn ships, and scikit-learn {why}. "
        f"Install it with: {DIGITS_INSTALL}  (or: pip install scikit-learn)"
    )
