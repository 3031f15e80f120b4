"""cluster tests."""
