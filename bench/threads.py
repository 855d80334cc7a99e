"""How many torch threads a bench run gets: ``--threads auto`` picks 1 on a busy CPU machine.

On 2 cores shared with another job, 2 torch threads spin against it: small ops were measured
3-30x slower (a 400x64 @ 64x1024 linear forward + backward: 2.6 ms with 1 thread, 78 ms with 2),
which turns a table into noise. 1 thread then shares the machine without that penalty.
"""
from __future__ import annotations

import os
import time


def busy_cores(seconds: float = 1.0) -> float:
    """Cores other processes keep busy right now (from /proc/stat over ``seconds``; the load average elsewhere)."""

    def sample():
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
        return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(total1 - total0, 1))
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def resolve_threads(value: str | int | None, device: str = "auto") -> int | None:
    """``None`` (torch's default) for ``None``/"torch", a number as given, and for "auto": 1 on a CPU run
    when other processes keep half a core or more busy, else torch's default."""
    if value is None or value == "torch":
        return None
    if value != "auto":
        return int(value)
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return None
    return 1 if busy_cores() >= 0.5 else None
