"""End what a killed attempt left RUNNING in MLflow.

Every run the pipeline opens is tagged with its process (``verl_core.pid``, ``verl_core.host``,
``verl_core.pid_start``: :func:`~verl_core.pipeline.workdir_lock.owner_tags`). When a run starts,
RUNNING runs of the experiment whose process on this host is gone (a ``kill -9``, a power loss, a
full disk that killed the process) are ended KILLED, with a note saying why. Runs of another host
are left alone: their processes cannot be checked from here.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.workdir_lock import owner_gone

log = logging.getLogger("verl_core")
NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI


def end_runs_of_dead_processes(config: PipelineConfig) -> list[str]:
    """End KILLED every RUNNING run whose process is gone; returns their ids."""
    c = tracking.client(config)
    ended = []
    runs = c.search_runs([tracking.experiment_id(config)], filter_string="attributes.status = 'RUNNING'", max_results=5000)
    for run in runs:
        tags = run.data.tags
        if not owner_gone(tags):
            continue
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        note = (
            f"Ended KILLED at {when} by process {os.getpid()} on {socket.gethostname()}: process "
            f"{tags['verl_core.pid']} on {tags['verl_core.host']} that ran it is gone (killed or crashed) and left "
            "it RUNNING. A later run recomputed or resumed its stage."
        )
        c.set_tag(run.info.run_id, NOTE_TAG, note)
        c.set_tag(run.info.run_id, "verl_core.reconciled", "killed")
        c.set_terminated(run.info.run_id, status="KILLED")
        ended.append(run.info.run_id)
    if ended:
        log.warning("ended %d MLflow run(s) left RUNNING by processes that are gone: %s", len(ended), ", ".join(ended))
    return ended
