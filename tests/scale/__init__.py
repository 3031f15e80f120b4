"""The scale harness: simulated worker hosts (:mod:`.simhost`) for hundreds of nodes and
thousands of stages on the local control plane (bench/scale.py, tests/scale/test_*.py)."""
