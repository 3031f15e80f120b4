"""Pytest fixtures for the local control plane (filled in by the cluster harness)."""
