"""Prefect settings this project relies on, applied before Prefect is imported.

Prefect reads its settings from the environment once, when it is imported; a default set afterwards is
never seen (the ephemeral API's start-up limit stayed at Prefect's 20 s, and busy machines timed out).
``tasks/__init__.py`` applies these before importing anything of Prefect's, and everything that imports
Prefect in this project (the tasks, the flows, the CLI) goes through it. A value the user set wins.
"""

from __future__ import annotations

import logging
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
    Prefect attaches to it; the root logger stays at Prefect's level.

    A worker starts a deployed run's process with ``python -m prefect.engine``, which configures logging
    before this project's defaults are applied, so ``PREFECT_LOGGING_EXTRA_LOGGERS`` came too late there
    and ``verl_core`` got no handler: the run's log in the UI showed no progress at all. The handlers
    Prefect would have attached (its API handler and its console) are attached here in that case."""
    project = logging.getLogger("verl_core")
    project.setLevel(logging.INFO)
    if not project.handlers:
        from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

        project.addHandler(APILogHandler())
        console = PrefectConsoleHandler()
        console.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s", "%H:%M:%S"))
        project.addHandler(console)
        project.propagate = False  # the root logger's own handler would print each line a second time


class QuietUserErrors(logging.Filter):
    """Drop the traceback Prefect logs with a failed task or flow when the error is the user's (a
    :class:`~verl_core.errors.UserError` names what to fix); it stays at DEBUG on ``verl_core.errors``.
    ``VERL_CORE_DEBUG=1`` (the CLI's ``--debug``) keeps every traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from verl_core.errors import UserError

        if record.exc_info and isinstance(record.exc_info[1], UserError):
            logging.getLogger("verl_core.errors").debug("traceback of: %s", record.getMessage(), exc_info=record.exc_info)
            record.exc_info, record.exc_text = None, None
        return True


def quiet_user_error_tracebacks() -> None:
    """Install :class:`QuietUserErrors` on Prefect's handlers (console and API) in this process."""
    if os.environ.get("VERL_CORE_DEBUG") == "1":
        return
    for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", ""):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, QuietUserErrors) for f in handler.filters):
                handler.addFilter(QuietUserErrors())
