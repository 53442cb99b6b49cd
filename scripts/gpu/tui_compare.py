"""Compare `sddoctor tui --json` with nvidia-smi for the same GPUs and processes.

usage: python scripts/gpu/tui_compare.py TUI_JSON SMI_GPU_CSV SMI_APPS_CSV
The CSVs come from nvidia-smi --format=csv,noheader,nounits with the fields in GPU_FIELDS and
APP_FIELDS. Prints a table (ours, nvidia-smi, difference, verdict) and exits 1 if a figure
that should agree does not. Utilization, power and clocks move between two reads a fraction
of a second apart, so they get a tolerance; names, bus ids, totals and process memory must agree.
"""

from __future__ import annotations

import csv
import json
import sys

GPU_FIELDS = [
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "clocks.sm",
    "clocks.mem",
    "pstate",
]
APP_FIELDS = ["gpu_uuid", "pid", "used_memory"]

MIB = 2**20


def _num(text: str) -> float | None:
    try:
        return float(text.strip().lstrip("P"))
    except ValueError:
        return None


def main() -> int:
    tui = json.load(open(sys.argv[1]))
    smi = {
        row[1].strip(): dict(zip(GPU_FIELDS, (c.strip() for c in row), strict=False))
        for row in csv.reader(open(sys.argv[2]))
        if row
    }
    apps = [
        dict(zip(APP_FIELDS, (c.strip() for c in row), strict=False))
        for row in csv.reader(open(sys.argv[3]))
        if row
    ]
    rows: list[tuple[str, str, str, str, str]] = []
    bad = 0

    def check(what: str, ours, theirs, tol: float | None, exact: bool = False) -> None:
        nonlocal bad
        if exact:
            ok = str(ours).strip().lower() == str(theirs).strip().lower()
            diff = "" if ok else "differs"
        elif ours is None or theirs is None:
            ok, diff = ours is None and theirs is None, "n/a"
        else:
            d = float(ours) - float(theirs)
            ok = abs(d) <= (tol or 0)
            diff = f"{d:+.1f}"
        bad += not ok
        rows.append((what, str(ours), str(theirs), diff, "ok" if ok else "MISMATCH"))

    for g in tui["gpus"]:
        s = smi.get(g["uuid"])
        if s is None:
            rows.append((f"GPU {g['index']}", g["uuid"], "not in nvidia-smi", "", "MISMATCH"))
            bad += 1
            continue
        p = f"GPU {g['index']} "
        check(p + "name", g["name"], s["name"], None, exact=True)
        check(
            p + "pci bus id", g["pci_bus_id"].lower()[-12:], s["pci.bus_id"].lower()[-12:], None, exact=True
        )
        check(p + "memory total MiB", round(g["memory_total"] / MIB), _num(s["memory.total"]), 1)
        check(p + "memory used MiB", round(g["memory_used"] / MIB), _num(s["memory.used"]), 64)
        check(p + "utilization %", g["utilization_gpu"], _num(s["utilization.gpu"]), 25)
        check(p + "temperature C", g["temperature"], _num(s["temperature.gpu"]), 3)
        check(p + "power W", g["power_draw"], _num(s["power.draw"]), 80)
        check(p + "power limit W", g["power_limit"], _num(s["power.limit"]), 1)
        check(p + "SM clock MHz", g["clock_sm"], _num(s["clocks.sm"]), 300)
        check(p + "mem clock MHz", g["clock_mem"], _num(s["clocks.mem"]), 50)
        check(p + "P-state", g["pstate"], _num(s["pstate"]), 0)
        for proc in g["processes"]:
            theirs = [a for a in apps if a["gpu_uuid"] == g["uuid"] and int(a["pid"]) == proc["pid"]]
            mem = round(proc["gpu_memory"] / MIB) if proc["gpu_memory"] is not None else None
            check(f"{p}pid {proc['pid']} MiB", mem, _num(theirs[0]["used_memory"]) if theirs else None, 2)
            rank = proc.get("rank")
            rows.append((f"{p}pid {proc['pid']} rank", json.dumps(rank), "", "", "info"))
    widths = [
        max(len(r[i]) for r in rows + [("figure", "sddoctor", "nvidia-smi", "diff", "")]) for i in range(5)
    ]
    header = ("figure", "sddoctor", "nvidia-smi", "diff", "")
    for r in [header, *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print(f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
