"""The API types: what a user writes and reads (spec, parsing, labels, conditions)."""
