"""Local process liveness, for telling a writer that died from one still at work."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
