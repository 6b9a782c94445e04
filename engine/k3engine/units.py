"""How a figure reads to a person: bytes (the reference's decimal units) and seconds (the
unit that suits the magnitude).  One place, so the same figure reads the same in the CLI's
report, the app and the tools."""
from __future__ import annotations

__all__ = ["human", "human_seconds"]


def human(b: float) -> str:
    """The reference's decimal-unit formatter: "%.2f" in B/KB/MB/GB/TB with 1000 steps.
    Divides step by step like the C loop, so the last digit rounds the same way."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    b = float(b)
    while b >= 1000.0 and i < 4:
        b /= 1000.0
        i += 1
    return f"{b:.2f} {units[i]}"


def human_seconds(s: float) -> str:
    """Seconds in the unit that suits the magnitude, three significant digits: "850 µs",
    "12.3 ms", "4.56 s", "2 min 5 s", "1 h 12 min".  The companion of `human` for
    every duration the app and the tools show (a "0.000 s" or "0.00 s/token" says
    nothing about a model that answers in microseconds)."""
    s = float(s)
    if s <= 0.0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms"
    if s < 60.0:
        return f"{s:.3g} s"
    if s < 3600.0:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
