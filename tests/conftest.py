"""Shared pytest configuration: the local control plane fixtures live in tests.cluster.

Property tests run without hypothesis's per-example deadline: on CI's loaded 2-core machine one
example of a pure function can take past its 200 ms default (seen in test_engine_layout), which
says nothing about the code under test. Speed targets live in bench/, not in unit tests.
"""

from hypothesis import settings

settings.register_profile("omnistage", deadline=None)
settings.load_profile("omnistage")

pytest_plugins = ["tests.cluster.pytest_plugin"]
