"""Samples of what a policy wrote, as MLflow traces linked to a run (MLflow's Traces tab and GenAI view).

A *sample* is a plain dict, the same for a training rollout and an evaluation answer::

    {"prompt": str, "completion": str, "reward": float | None, "ground_truth": str | None,
     "turns": [...],            # agent episodes only: Episode.turns (assistant text + tool calls, tool results)
     "truncated": str | None}

Each becomes one trace named ``<kind> step <N>`` whose root span holds the prompt and the completion
with its reward; an agent episode gets one child span per assistant turn (type LLM) and, under it, one
per tool call (type TOOL) with its arguments, result and error status, so a bad sample behind a metric
dip opens turn by turn. Traces carry the tags ``verl_core.kind``, ``verl_core.step`` and
``verl_core.reward`` to filter on. MLflow is imported lazily (the kernel runs without a tracking server).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger("verl_core")

Sample = dict[str, Any]
TEXT_LIMIT = 4000  # characters of prompt / completion kept per span: a trace is for reading, not a dataset


def _clip(text: Any) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= TEXT_LIMIT else text[: TEXT_LIMIT - 3] + "..."


def log_sample_traces(client, run_id: str, kind: str, step: int, samples: Sequence[Sample]) -> list[str]:
    """One MLflow trace per sample, linked to ``run_id`` (in its experiment); the trace ids.

    A failure to write traces is logged and skipped: traces are for looking at, never a reason to fail
    a training run."""
    try:
        experiment_id = client.get_run(run_id).info.experiment_id
        with _exporting_to(client.tracking_uri):
            return [_one_trace(client, experiment_id, run_id, kind, step, i, s) for i, s in enumerate(samples)]
    except Exception as err:  # noqa: BLE001 - see docstring
        log.warning("could not log %d %s samples as MLflow traces: %s", len(samples), kind, err)
        return []


@contextlib.contextmanager
def _exporting_to(uri: str) -> Iterator[None]:
    """MLflow exports finished traces to the process-wide tracking URI, in a background queue: point it at
    the client's store for the block and flush the queue before leaving, so the traces land in that store
    and are there when this returns."""
    import mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    # trace and span ids come from Python's `random` (OpenTelemetry's generator), which training seeds: two
    # runs with one seed would write the same trace ids and overwrite each other's traces. Draw them from
    # fresh entropy, and give training its random stream back untouched (a resumed run samples the same).
    state = random.getstate()
    random.seed(os.urandom(16))
    try:
        yield
    finally:
        try:  # the export queue's thread may still draw ids: flush it before giving the stream back
            mlflow.flush_trace_async_logging()
        finally:
            random.setstate(state)
            mlflow.set_tracking_uri(before)


def _one_trace(client, experiment_id: str, run_id: str, kind: str, step: int, index: int, sample: Sample) -> str:
    reward = sample.get("reward")
    tags = {"verl_core.kind": kind, "verl_core.step": str(step), "verl_core.sample": str(index)}
    if reward is not None:
        tags["verl_core.reward"] = f"{float(reward):.6g}"
    inputs = {"prompt": _clip(sample.get("prompt"))}
    if sample.get("ground_truth") is not None:
        inputs["ground_truth"] = _clip(sample["ground_truth"])
    root = client.start_trace(
        f"{kind} step {step}",
        span_type="CHAIN" if sample.get("turns") else "LLM",
        inputs=inputs,
        attributes={"step": step, "sample": index},
        tags=tags,
        experiment_id=experiment_id,
        run_id=run_id,
    )
    turns = sample.get("turns") or []
    assistant = [i for i, t in enumerate(turns) if t.get("role") == "assistant"]
    for turn_index, i in enumerate(assistant):
        answer = turns[i + 1] if i + 1 < len(turns) and turns[i + 1].get("role") == "tool" else {}
        _turn_spans(client, root, turn_index, turns[i], answer)  # the tool turn answering its calls, if any
    outputs = {"completion": _clip(sample.get("completion")), "reward": reward}
    if sample.get("truncated"):
        outputs["truncated"] = sample["truncated"]
    client.end_trace(root.trace_id, outputs=outputs)
    return root.trace_id


def _turn_spans(client, root, turn_index: int, turn: dict, results: dict) -> None:
    calls = turn.get("tool_calls") or []
    span = client.start_span(
        f"turn {turn_index + 1}",
        trace_id=root.trace_id,
        parent_id=root.span_id,
        span_type="LLM",
        inputs={"turn": turn_index + 1},
        attributes={"tool_calls": len(calls)},
    )
    texts, oks = results.get("results") or [], results.get("ok") or []
    for k, call in enumerate(calls):
        ok = oks[k] if k < len(oks) else None
        tool = client.start_span(
            str(call.get("name", "tool")),
            trace_id=root.trace_id,
            parent_id=span.span_id,
            span_type="TOOL",
            inputs={"arguments": call.get("arguments")},
            attributes={"ok": ok},
        )
        result = texts[k] if k < len(texts) else None
        client.end_span(
            root.trace_id,
            tool.span_id,
            outputs={"result": _clip(result)},
            status="OK" if ok is not False else "ERROR",
        )
    client.end_span(root.trace_id, span.span_id, outputs={"text": _clip(turn.get("text"))})
