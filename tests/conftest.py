"""Every test's kind from its directory, fixtures shared across test modules, and the `cuda`
marker's skip.

tests/unit/ starts no process, tests/world/ runs multi-process worlds in this process
(support/world.py, support/ps_world.py), tests/e2e/ runs commands as a user does; each test
is marked with its directory's name, so `pytest -m unit` (or `world`, `e2e`) runs one kind.
"""

from pathlib import Path

import pytest
import torch

# netns_hosts: network namespaces as hosts; fake_profiling, no_calibration: the planner's;
# shared_runs: command runs whose end several modules read
pytest_plugins = ["support.netns", "support.plan_profiles", "support.shared_runs"]

KINDS = ("unit", "world", "e2e")
TESTS = Path(__file__).resolve().parent


def _no_gpu_reason() -> str | None:
    """Why `cuda` tests cannot run here, or None where they can."""
    if not torch.cuda.is_available():
        built = "a CUDA build" if torch.version.cuda else "a CPU-only build"
        return f"needs a CUDA GPU: torch.cuda.is_available() is False ({built} of torch)"
    return None


def _kind(item: pytest.Item) -> str:
    """The kind of a test: the directory below tests/ that holds its file."""
    path = item.path.resolve()
    kind = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else None
    if kind not in KINDS:
        raise pytest.UsageError(
            f"{item.nodeid}: a test lives in tests/unit/, tests/world/ or tests/e2e/ "
            f"(its kind), not in {path.parent}"
        )
    return kind


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(_kind(item))
    reason = _no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
