"""Byte sizes: parse and format them, and discretise them into slots.

The solver works in whole slots of ``slot_bytes`` (docs/architecture.md, "One model of memory"): every
size is rounded UP to whole slots and a budget is rounded DOWN, so a plan chosen for a budget
of ``m`` slots never needs more than ``m * slot_bytes`` bytes. These are pure functions so
the CLI, the service and the store can share one reading of ``30MB`` or ``2GiB``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from core.errors import UsageError

# Decimal units are powers of 1000, binary ones powers of 1024 (MB = 10^6, MiB = 2^20).
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """A size such as ``1048576``, ``30MB``, ``1.5GB``, ``2GiB`` or ``512kib`` as whole bytes.

    Units are case-insensitive; fractions of a byte are dropped (a budget is never rounded up).
    """
    if isinstance(text, bool):
        raise UsageError(f"size {text!r} is not a number of bytes")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size {text} is negative; give a number of bytes >= 0")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"cannot read {text!r} as a size: give bytes (1048576) or a number with "
                         f"a unit, e.g. 30MB, 1.5GB, 512KiB, 2GiB (MB = 10^6, MiB = 2^20)")
    number, unit = match.group(1), match.group(2).lower()
    if unit not in _UNITS:
        raise UsageError(f"unknown size unit {match.group(2)!r} in {text!r}: use B, KB, MB, GB, TB "
                         f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    try:
        value = Decimal(number) * _UNITS[unit]
    except InvalidOperation as exc:  # the regex makes this unreachable; keep the contract anyway
        raise UsageError(f"cannot read {text!r} as a size") from exc
    return int(value)  # int() of a Decimal truncates toward zero: never more than was given


def format_bytes(n: int | float | None) -> str:
    """A short human reading of a byte count (binary units): ``512 B``, ``1.50 MiB``."""
    if n is None:
        return "-"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


CUDA_GRANULE = 512  # PyTorch's CUDA caching allocator rounds every block up to 512 bytes


def granule_for(device: str) -> int:
    """The allocation granule of a device type: 512 bytes on CUDA, 1 on CPU."""
    return CUDA_GRANULE if device.startswith("cuda") else 1


def allocation(nbytes: int, granule: int = 1) -> int:
    """Bytes an allocator takes for a request of ``nbytes``: whole granules (512 for CUDA's
    caching allocator, 1 on CPU). Every byte count of the executor's memory goes through here."""
    return -(-int(nbytes) // granule) * granule


def slots_up(nbytes: int, slot_bytes: int) -> int:
    """Whole slots needed to hold ``nbytes``: a size is rounded up."""
    return -(-int(nbytes) // slot_bytes)


def slots_down(budget_bytes: int, slot_bytes: int) -> int:
    """Whole slots available in ``budget_bytes``: a budget is rounded down."""
    return int(budget_bytes) // slot_bytes


def check_slot_bytes(slot_bytes: int) -> int:
    """``slot_bytes`` as a positive int, or a UsageError saying what to give."""
    if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 1:
        raise UsageError(f"slot size must be a whole number of bytes >= 1, got {slot_bytes!r}")
    return slot_bytes


def parse_budgets(text: str, low: int, high: int) -> list[int]:
    """``15MB:40MB:5MB`` (inclusive), ``10MB,20MB``, or ``auto[:N]`` (N budgets from the
    least any plan of the request runs in up to where fbs runs it whole, spaced evenly on a
    log scale: denser at the bottom, where memory binds and plans differ most; fewer than N
    where the range holds fewer distinct budgets, one where fbs-best's least is fbs's whole).
    Always distinct and ascending for ``auto``: a budget twice would be two rows of one bench."""
    if text.startswith("auto"):
        try:
            n = int(text.split(":", 1)[1]) if ":" in text else 10
        except ValueError:
            raise UsageError(f"--memory {text!r}: give auto or auto:N with N a whole number") from None
        if n < 2:
            raise UsageError("--memory auto:N needs N >= 2")
        if high <= low:
            return [low]
        if low <= 0:
            return sorted({int(low + (high - low) * k / (n - 1)) for k in range(n)})
        return sorted({int(round(low * (high / low) ** (k / (n - 1)))) for k in range(n)})
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise UsageError(f"--memory {text!r}: give START:STOP:STEP, e.g. 15MB:40MB:5MB")
        start, stop, step = (parse_bytes(p) for p in parts)
        if step <= 0 or stop < start:
            raise UsageError(f"--memory {text!r}: STEP must be > 0 and STOP >= START")
        out, b = [], start
        while b <= stop:
            out.append(b)
            b += step
        return out
    return [parse_bytes(p) for p in text.split(",") if p.strip()]
