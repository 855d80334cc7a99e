"""The Prefect side of reconciling a killed attempt: its flow and task runs left Running.

A ``kill -9`` gives Prefect no chance to report the end of a run, and without a worker heartbeat
(a local, serverless run has none) the API keeps it Running forever. Each pipeline flow run is
tagged with its process (``verl_core.pid:<pid>``, ``verl_core.host:<host>``,
``verl_core.pid_start:<t>``); a new pipeline run sets Running flow runs whose process on this host
is gone, and their Running task runs, to Crashed with a message saying why.
"""

from __future__ import annotations

import logging

from verl_core.pipeline.workdir_lock import owner_gone, owner_tags

log = logging.getLogger("verl_core")
TAG_PREFIX = "verl_core."


def tag_this_flow_run(flow_run_id) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        mine = [f"{k}:{v}" for k, v in owner_tags().items() if v]
        client.update_flow_run(flow_run_id, tags=[t for t in run.tags if not t.startswith(TAG_PREFIX)] + mine)


def _owner(tags: list[str]) -> dict[str, str]:
    return dict(t.split(":", 1) for t in tags if t.startswith(TAG_PREFIX) and ":" in t)


def crash_runs_of_dead_processes() -> list[str]:
    """Set Running flow runs (and their Running task runs) of processes that are gone to Crashed."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    ended = []
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(state=running), limit=200):
            owner = _owner(run.tags)
            if not owner_gone(owner):
                continue
            why = f"process {owner['verl_core.pid']} on {owner['verl_core.host']} that ran it is gone (killed or crashed)"
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id={"any_": [run.id]}),
                # name=None: prefect < 3.9 requires the field (3.7.7 is what the [vllm] extra resolves to)
                task_run_filter=TaskRunFilter(
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING]), name=None)
                ),
            )
            for task_run in tasks:
                client.set_task_run_state(task_run.id, Crashed(message=f"ended by a later run: the {why}"), force=True)
            client.set_flow_run_state(run.id, Crashed(message=f"ended by a later run: the {why}"), force=True)
            ended.append(str(run.id))
    if ended:
        log.warning(
            "set %d Prefect flow run(s) left Running by processes that are gone to Crashed: %s", len(ended), ", ".join(ended)
        )
    return ended
