"""Fixtures shared across test modules."""

pytest_plugins = ["netns"]  # hosts, netns_hosts: network namespaces as hosts (tests/netns.py)
