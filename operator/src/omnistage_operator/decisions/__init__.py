"""The pure decisions: the arbiter, the hand-over round, worker facts, status (no I/O)."""
