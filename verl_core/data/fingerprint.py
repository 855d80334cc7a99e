"""Content fingerprints of files and folders: what cache keys and provenance records hash."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint_path(path: str | os.PathLike, suffixes: tuple[str, ...] | None = None) -> str:
    """sha256 over (relative path, content) of every file under ``path`` (only names ending in
    ``suffixes`` when given), sorted; a path that does not exist (a hub id) hashes its name."""
    p = Path(path).expanduser()
    h = hashlib.sha256()
    if p.is_file():
        files, base = [p], p.parent
    elif p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and not f.name.startswith(".tmp") and (suffixes is None or f.name.endswith(suffixes))
        )
        base = p
    else:
        return hashlib.sha256(f"remote:{path}".encode()).hexdigest()
    for f in files:
        h.update(str(f.relative_to(base)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()
