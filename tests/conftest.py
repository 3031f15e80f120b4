"""Shared pytest configuration: the local control plane fixtures live in tests.cluster."""

pytest_plugins = ["tests.cluster.pytest_plugin"]
