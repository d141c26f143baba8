"""engine.units: the one way sizes and counts are written (binary IEC units for bytes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.units import format_bytes, format_count, parse_count


def test_bytes_use_binary_units_with_iec_names() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"
    assert format_bytes(2 * 1024**4) == "2.0 TiB"
    assert format_bytes(5 * 1024**6) == "5120.0 PiB"  # the largest unit keeps growing
    assert format_bytes(-1536) == "-1.5 KiB"  # a shortfall keeps its sign
    assert format_bytes(140 * 2**30 + 2**29, decimals=0) == "140 GiB"


def test_counts_have_three_significant_digits() -> None:
    assert format_count(134_515_008) == "135M"
    assert format_count(7_241_732_096) == "7.24B"
    assert format_count(1.5e12) == "1.5T"
    assert format_count(999) == "999"
    assert format_count(None) == "?" and format_count(0) == "?"
    assert format_count(None, unknown="") == ""


@pytest.mark.parametrize(
    "text, value", [("7B", 7e9), ("500M", 5e8), (" 1.5b ", 1.5e9), ("2k", 2e3), ("42", 42)]
)
def test_parse_count_reads_what_format_count_writes(text: str, value: float) -> None:
    assert parse_count(text) == value
    assert parse_count(format_count(value)) == pytest.approx(value, rel=1e-2)


@pytest.mark.parametrize("text", ["", "B", "7 GB", "1e9", "-3M"])
def test_parse_count_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="not a parameter count"):
        parse_count(text)


def test_units_import_without_torch() -> None:
    # The GUI thread formats sizes; importing the formatter must not start torch.
    code = "import sys, engine.units; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
