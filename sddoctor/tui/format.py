"""Short human formats shared by the text snapshot (`--once`) and the app."""

from __future__ import annotations

SPARK_CHARS = " ▁▂▃▄▅▆▇█"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def gib_short(n: int | None) -> str:
    """GiB in at most 4-5 characters: 0.6, 53.1, 140 (no decimal from 100 on)."""
    if n is None:
        return "-"
    v = n / 2**30
    return f"{v:.0f}" if v >= 99.95 else f"{v:.1f}"


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def num(v: float | int | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def rate(bps: float | None) -> str:
    if bps is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def loss_short(v: float | None) -> str:
    """A loss in at most 8 characters: 0.1234, 12.35, 1.23e-05."""
    if v is None:
        return "-"
    if v != 0 and not 1e-3 <= abs(v) < 1e4:
        return f"{v:.2e}"
    return f"{v:.4g}"


def age(seconds: float | None) -> str:
    """A duration in at most 6 characters: 4s, 95s, 1m40s, 12m, 3h07m."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 600:
        return f"{s}s" if s < 100 else f"{s // 60}m{s % 60:02d}s"
    if s < 3600:
        return f"{s // 60}m"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def sparkline(values: list[float], width: int, top: float = 100.0) -> str:
    """The last `width` values as block characters scaled to [0, top]."""
    if top <= 0:
        return " " * width
    steps = len(SPARK_CHARS) - 1
    scale = steps / top
    chars = SPARK_CHARS
    return "".join(chars[min(steps, max(0, round(v * scale)))] for v in values[-width:]).rjust(width)


def bar(frac: float | None, width: int) -> str:
    if frac is None:
        return " " * width
    filled = round(max(0.0, min(1.0, frac)) * width)
    return "█" * filled + "░" * (width - filled)


def rank_label(rank: int | None, local: int | None, world: int | None) -> str:
    if rank is None:
        return "-"
    return f"{rank}/{world if world is not None else '?'} (l{local if local is not None else '?'})"
