"""Prefect settings this project relies on, applied before Prefect is imported.

Prefect reads its settings from the environment once, when it is imported; a default set afterwards is
never seen (the ephemeral API's start-up limit stayed at Prefect's 20 s, and busy machines timed out).
``tasks/__init__.py`` applies these before importing anything of Prefect's, and everything that imports
Prefect in this project (the tasks, the flows, the CLI) goes through it. A value the user set wins.
"""

from __future__ import annotations

import os

STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # the project's log records (training progress, metric lines, warnings) in the run's log in the UI
    "PREFECT_LOGGING_EXTRA_LOGGERS": "verl_core",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",  # the CLI's own lines before a run starts
    STARTUP_TIMEOUT_SETTING: "120",  # the temporary local API starts slowly on a busy laptop (Prefect's default: 20)
}


def apply_defaults() -> None:
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)


def startup_timeout() -> str:
    return os.environ.get(STARTUP_TIMEOUT_SETTING, DEFAULTS[STARTUP_TIMEOUT_SETTING])


def project_logging() -> None:
    """INFO records of ``verl_core`` (progress lines at a bounded rate, the trainers' notes) reach the handlers
    Prefect attaches to it; the root logger stays at Prefect's level."""
    import logging

    logging.getLogger("verl_core").setLevel(logging.INFO)
