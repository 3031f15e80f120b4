"""Kubernetes quantity parsing and byte formatting: the one grammar (operator and worker)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnistage_worker.quantities import (
    QUANTITY_PATTERN,
    QuantityError,
    format_bytes,
    format_quantity,
    parse_quantity,
)

GiB = 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16Gi", 16 * GiB),
        ("500M", 500_000_000),
        ("1.5e9", 1_500_000_000),
        ("1.5E9", 1_500_000_000),
        ("1024", 1024),
        ("1k", 1000),
        ("1Ki", 1024),
        ("0.5Gi", GiB // 2),
        (".5Mi", 512 * 1024),
        ("+2Ti", 2 * 1024**4),
        ("1500m", 2),  # fractions round up, as resource.Quantity.Value() does
        ("1n", 1),
        ("0", 0),
        (" 8Gi ", 8 * GiB),
        (" 7 ", 7),
        ("80Gi", 80 * GiB),
        ("1.5Gi", 3 * 2**29),
        ("2G", 2 * 10**9),
        ("4k", 4000),
        (12345, 12345),
    ],
)
def test_parse_quantity(text: str | int, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "Gi",
        "16GB",
        "16gi",
        "-1Gi",
        "1.2.3",
        "1e",
        "ten",
        "16 Gi",
        "1e999",
        "12Xi",
        "4K",
        -5,
        True,
        1.5,
    ],
)
def test_parse_quantity_rejects(bad: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0"),
        (512, "512"),
        (1024, "1Ki"),
        (1536, "1.5Ki"),
        (int(3.2 * GiB), "3.2Gi"),
        (16 * GiB, "16Gi"),
        (1023 * 1024 * 1024 + 1000 * 1024, "1Gi"),
        (80 * GiB, "80Gi"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


def test_format_negative_keeps_sign() -> None:
    assert format_bytes(-1536) == "-1.5Ki"
    assert format_bytes(-int(3.2 * GiB)) == "-3.2Gi"
    with pytest.raises(QuantityError):
        format_quantity(-1)


def test_pattern_is_the_parser_grammar() -> None:
    import re

    assert re.fullmatch(QUANTITY_PATTERN, "16Gi")
    assert not re.fullmatch(QUANTITY_PATTERN, "16GB")


@given(st.integers(min_value=0, max_value=2**70))
def test_format_quantity_round_trips_exactly(n: int) -> None:
    assert parse_quantity(format_quantity(n)) == n


@given(st.integers(min_value=0, max_value=2**70))
def test_format_bytes_round_trips_within_five_percent(n: int) -> None:
    text = format_bytes(n)
    back = parse_quantity(text)
    assert abs(back - n) <= 0.05 * n
    assert len(text) <= 6


@given(st.integers(min_value=0, max_value=2**60))
def test_plain_integers_parse_to_themselves(n: int) -> None:
    assert parse_quantity(str(n)) == n


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["Ki", "Mi", "Gi", "Ti", "k", "M", "G", "T"]),
)
def test_suffixes_scale(n: int, suffix: str) -> None:
    factor = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}.get(suffix) or {
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }[suffix]
    assert parse_quantity(f"{n}{suffix}") == n * factor


def test_operator_and_worker_share_one_grammar() -> None:
    from omnistage_worker import config
    from omnistage_worker import quantities as operator_quantities

    assert operator_quantities.parse_quantity is parse_quantity
    assert operator_quantities.format_bytes is format_bytes
    assert config.parse_byte_flag("1.5e3", "--residual-slack") == 1500
    with pytest.raises(config.ConfigError) as info:
        config.parse_byte_flag("16 Gi", "--residual-slack")
    assert info.value.flag == "--residual-slack"
