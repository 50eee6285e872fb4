"""Sizes: parse_bytes / format_bytes and the slot rounding every solver relies on."""

from __future__ import annotations

import pytest

from core.errors import UsageError
from core.sizes import check_slot_bytes, format_bytes, parse_bytes, slots_down, slots_up


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("1048576", 1048576), (" 7 ", 7), ("7B", 7), ("30MB", 30 * 10**6),
    ("30mb", 30 * 10**6), ("1.5GB", 1_500_000_000), ("2GiB", 2 * 2**30), ("2gib", 2 * 2**30),
    ("512KiB", 512 * 1024), ("512 kib", 512 * 1024), ("1kb", 1000), ("3TiB", 3 * 2**40),
    ("0.5KiB", 512), ("1.2345KB", 1234), ("1e3", 1000), (123, 123),
])
def test_parse_bytes_reads_plain_and_unit_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5", "1.2.3MB", "5 M B", "ten", "5m", True, -1])
def test_parse_bytes_rejects_bad_text_with_a_usage_error(text):
    with pytest.raises(UsageError) as err:
        parse_bytes(text)
    assert str(err.value)  # says what was wrong


def test_parse_bytes_message_lists_the_units():
    with pytest.raises(UsageError, match="KiB"):
        parse_bytes("4 parsecs")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                     (1536, "1.50 KiB"), (30 * 2**20, "30.00 MiB"),
                                     (2 * 2**30, "2.00 GiB"), (None, "-"), (-2048, "-2.00 KiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_slots_round_sizes_up_and_budgets_down():
    assert slots_up(0, 10) == 0 and slots_up(1, 10) == 1 and slots_up(10, 10) == 1
    assert slots_up(11, 10) == 2
    assert slots_down(9, 10) == 0 and slots_down(10, 10) == 1 and slots_down(29, 10) == 2
    assert check_slot_bytes(4096) == 4096
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError):
            check_slot_bytes(bad)
