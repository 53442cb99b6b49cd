"""Clock-event ("throttle") reasons: NVML's bit mask decoded to short words.

The bits are NVML's `nvmlClocksEventReason*` constants (called `nvmlClocksThrottleReason*` in
older drivers); their values have been stable since the API appeared, so they are written here
rather than looked up, which also makes decoding work on a machine without NVML.
"""

from __future__ import annotations

#: bit -> (word shown, what it means; docs/tui.md repeats this table)
CLOCK_EVENT_REASONS: dict[int, tuple[str, str]] = {
    0x001: ("idle", "nothing runs on the GPU, clocks are lowered"),
    0x002: ("app-clocks", "application clocks setting (nvidia-smi -ac) limits the clocks"),
    0x004: ("sw-power-cap", "power draw reached the software power limit"),
    0x008: ("hw-slowdown", "hardware slowdown (temperature or power brake), clocks cut hard"),
    0x010: ("sync-boost", "held back to match other GPUs in a sync-boost group"),
    0x020: ("sw-thermal", "software thermal slowdown: GPU or memory temperature too high"),
    0x040: ("hw-thermal", "hardware thermal slowdown: temperature too high"),
    0x080: ("power-brake", "external power brake signal (power supply) asserted"),
    0x100: ("display-clocks", "display clock setting limits the clocks"),
}

#: Reasons that mean the GPU is slower than it could be while working (worth an alert).
SLOWDOWN_BITS = 0x004 | 0x008 | 0x020 | 0x040 | 0x080


def decode_clock_events(mask: int | None) -> list[str]:
    """Words for the set bits, in bit order; unknown bits appear as hex."""
    if not mask:
        return []
    words = []
    rest = mask
    for bit, (word, _) in CLOCK_EVENT_REASONS.items():
        if mask & bit:
            words.append(word)
            rest &= ~bit
    if rest:
        words.append(f"0x{rest:x}")
    return words


def is_slowdown(mask: int | None) -> bool:
    return bool(mask and mask & SLOWDOWN_BITS)
