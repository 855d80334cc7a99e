"""What the model loaders and the GGUF converter share: the error naming a model that cannot be loaded (kept
apart so that the converter and the bundled-model lookup need not import the loader that raises it too)."""

from __future__ import annotations

from verl_core.errors import UserError


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer that cannot be loaded; the message says which and why."""
