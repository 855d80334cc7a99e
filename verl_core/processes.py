"""This host's processes and addresses: whether a writer died or is still at work, and whether an address
reaches only this host (the loopback default of the launchers and of the reward service)."""

from __future__ import annotations

import ipaddress
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


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (brackets allowed)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
