"""Sizes and rates as people write them: bytes (4K, 64M) and link rates (100mbit, 1gbit).

Used by every command that takes one (`plait bench`, `plait plan`); nothing of plait's
imported here.
"""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'64K' -> 65536; accepts K, M, G suffixes (powers of 1024) and plain byte counts."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"size must look like 4K, 1M, 64M or 1024; got {text!r}") from None
    if value <= 0 or value % 4:
        raise ValueError(f"size must be a positive multiple of 4 bytes (float32); got {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """'4K,1M' -> [4096, 1048576]; ValueError naming the first bad one."""
    return [parse_size(s) for s in text.split(",")]


def format_size(n: int) -> str:
    """4096 -> '4K': the largest of G, M, K that divides `n`, else the plain count."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


#: tc's rate units (SI, bits): what `--link-rate` takes, as netns.sh passes it to tc tbf
RATE_UNITS = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}


def parse_rate(text: str) -> int:
    """'100mbit' -> 100_000_000 bits/s; tc's units gbit, mbit, kbit, bit (powers of 1000)."""
    low = text.strip().lower()
    unit = next((u for u in RATE_UNITS if low.endswith(u)), None)
    try:
        value = float(low.removesuffix(unit)) * RATE_UNITS[unit] if unit else None
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ValueError(
            f"a link rate must look like 100mbit or 1gbit ({', '.join(RATE_UNITS)}); got {text!r}"
        )
    return int(value)
