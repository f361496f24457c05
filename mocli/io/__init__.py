"""Readers and writers: bytes and headers only, nothing about quantization."""


def human_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in binary units: 512 B, 1.50 KiB, 3.95 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n} B"
