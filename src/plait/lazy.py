"""Names a package imports on first use (PEP 562), so that importing the package stays cheap:
`plait --help` and `plait run` load no torch.

The one way plait defers an import: every package that exports names needing torch (the
`plait` root included) sets `__getattr__ = getattr_from(__name__, {name: module})`, and
lists the same names under `if TYPE_CHECKING:` for type checkers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def getattr_from(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `table` maps a name to the module defining it,
    imported on first use; the value is then kept in the package."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
