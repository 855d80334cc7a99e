"""The root of the project's error classes.

Every error a user can cause (a config, data, model, checkpoint, workdir, tracking URI) derives
from :class:`UserError`. That is what the CLI prints as one paragraph (exit 1, or 2 for
configuration), and what the Prefect task does not retry: the same input fails the same way.
"""

from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave (not a bug, not a transient failure): retrying cannot help.

    Each subclass also derives from the builtin it refines (``ValueError``, ``RuntimeError``), so
    ``except ValueError`` in callers keeps working."""

    exit_code = 1


class WorkdirError(UserError, OSError):
    """The pipeline's workdir cannot be used: a file, not writable, locked by another run."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (non-finite loss, too little data, ...)."""


class TrackingError(UserError, ConnectionError):
    """The MLflow tracking URI cannot be reached or written; checked before any training."""
