"""Where the engine's checkpoints live and how a complete one is recognised.

``<output_dir>/checkpoints/step-NNNNNNNN`` folders, each written under a temporary name and
renamed when complete; ``engine_state.json`` inside is written last, so a folder without it is
an interrupted write, never resumed from.
"""

from __future__ import annotations

import json
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"
ENGINE_STATE = "engine_state.json"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir/checkpoints`` (one with its engine state), or None."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / ENGINE_STATE).is_file())
    return done[-1] if done else None


def checkpoint_step(path: str | Path) -> int:
    """The loop step a checkpoint folder was written at."""
    return int(json.loads((Path(path) / ENGINE_STATE).read_text())["step"])
