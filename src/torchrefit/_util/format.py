"""How torchrefit writes quantities for people (plans, reports, benchmark tables)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float | None, digits: int = 2) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units; whole bytes below 1 KB); None -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1000
    return f"{n:.{digits}f} TB"
