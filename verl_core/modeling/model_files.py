"""What the model loaders and the GGUF converter share: the error naming a model that cannot be loaded, and
the clean-up of folders a killed writer left under a temporary name (kept apart so that the converter and
the bundled-model lookup need not import the loader that calls them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from verl_core.errors import UserError
from verl_core.processes import pid_alive


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""


def remove_partial_writes(target: Path) -> None:
    """Delete ``.<name>-<pid>-*`` folders that a killed save of ``target`` left (their process is gone)."""
    for partial in target.parent.glob(f".{target.name}-*"):
        pid = partial.name[len(target.name) + 2 :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)
