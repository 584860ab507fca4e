"""Parsing and printing byte sizes ("64 MiB", "1.5GB", 4096)."""

import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORM = "an int number of bytes or a string like '512 KiB', '64 MiB', '2 GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


def parse_size(size) -> int:
    """Bytes for an int or a size string; ValueError naming the expected form otherwise."""
    if isinstance(size, bool):
        raise ValueError(f"size must be {SIZE_FORM}, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size must not be negative, got {size}")
        return size
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match:
            unit = match.group(2).lower() or "b"
            if unit in _UNITS:
                return int(float(match.group(1)) * _UNITS[unit])
    raise ValueError(f"size must be {SIZE_FORM}, got {size!r}")


def format_bytes(nbytes) -> str:
    """Human-readable binary size, keeping the sign ("-3.0 MiB")."""
    if nbytes is None:
        return "-"
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    level = 0
    while value >= 1024 and level < len(units) - 1:
        value /= 1024
        level += 1
    if level == 0:
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.1f} {units[level]}"
