"""README.md quotes the committed benchmark results exactly (bench/report.py renders them)."""

from __future__ import annotations

from bench.report import BEGIN, END, README, render


def test_readme_benchmark_section_matches_results() -> None:
    readme = README.read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == render(), "run `python bench/report.py --write` and commit"
