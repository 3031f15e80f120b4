"""Tiny programs the cluster tests run as localnode pod containers."""
