"""When a string names a hub repository rather than a local path.

A typo in a local path must never turn into a download, so a string is a hub id only when it says
so (``hf://org/name``) or when ``VERL_CORE_ALLOW_HUB_IDS=1`` allows bare ids (``org/name``) for a
string that does not look like a path. Everything else is a local path, and a missing one is an
error naming it. Downloads also need the hub online (``HF_HUB_OFFLINE`` unset; the CLI sets it
unless given ``--online``).
"""

from __future__ import annotations

import os
from pathlib import Path

HUB_PREFIX = "hf://"
ALLOW_BARE_IDS = "VERL_CORE_ALLOW_HUB_IDS"


def hub_id(text: str) -> str | None:
    """The hub id ``text`` names, or None when it is to be read as a local path."""
    if text.startswith(HUB_PREFIX):
        return text.removeprefix(HUB_PREFIX)
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") != 1 or Path(text).exists()
    if os.environ.get(ALLOW_BARE_IDS) == "1" and not looks_like_path:
        return text
    return None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"


def not_found_hint(text: str) -> str:
    """A hint for a missing path that could have meant a hub id (``org/name``); none for what is plainly a path."""
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        return ""
    return f" (a hub id is written {HUB_PREFIX}{text}, or set {ALLOW_BARE_IDS}=1 to read org/name as one)"
