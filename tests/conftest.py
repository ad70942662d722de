"""Fixtures shared across test modules, and the `cuda` marker's skip."""

import pytest
import torch

pytest_plugins = ["support.netns"]  # hosts, netns_hosts: network namespaces as hosts


def _no_gpu_reason() -> str | None:
    """Why `cuda` tests cannot run here, or None where they can."""
    if not torch.cuda.is_available():
        built = "a CUDA build" if torch.version.cuda else "a CPU-only build"
        return f"needs a CUDA GPU: torch.cuda.is_available() is False ({built} of torch)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
