"""Samples of what a policy wrote become MLflow traces linked to the run: prompt, completion and reward on
the root span; for an agent episode one span per turn and one per tool call, a failed call marked ERROR."""

from __future__ import annotations

import pytest

EPISODE = {
    "prompt": "What is 17 * 23? Use the calculator.",
    "completion": "391",
    "reward": 1.0,
    "ground_truth": "391",
    "truncated": None,
    "turns": [
        {
            "role": "assistant",
            "text": '<tool_call>{"name": "calculator", "arguments": {"expression": "17*"}}',
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "17*"}}],
        },
        {"role": "tool", "results": ["error: invalid syntax"], "ok": [False]},
        {
            "role": "assistant",
            "text": '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}',
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "17*23"}}],
        },
        {"role": "tool", "results": ["391"], "ok": [True]},
        {"role": "assistant", "text": "391", "tool_calls": []},
    ],
}


def _spans(trace):
    return {s.name: s for s in trace.data.spans}


@pytest.mark.slow  # a fresh MLflow SQLite store (schema migrations) takes seconds
def test_an_agent_episode_is_a_trace_with_a_span_per_turn_and_per_tool_call(tmp_path):
    from mlflow import MlflowClient

    from verl_core.train.traces import log_sample_traces

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("traces")
    run = client.create_run(exp).info.run_id
    plain = {"prompt": "2+2=", "completion": "4", "reward": 0.0, "ground_truth": "5"}
    ids = log_sample_traces(client, run, "rollout", 7, [EPISODE, plain])
    assert len(ids) == 2

    found = client.search_traces(locations=[exp], run_id=run)
    assert sorted(t.info.trace_id for t in found) == sorted(ids)
    episode = client.get_trace(ids[0])
    assert episode.info.tags["verl_core.kind"] == "rollout" and episode.info.tags["verl_core.step"] == "7"
    assert episode.info.tags["verl_core.reward"] == "1"
    spans = _spans(episode)
    root = spans["rollout step 7"]
    assert root.inputs == {"prompt": EPISODE["prompt"], "ground_truth": "391"}
    assert root.outputs == {"completion": "391", "reward": 1.0}
    assert {"turn 1", "turn 2", "turn 3"} <= set(spans)
    tools = [s for s in episode.data.spans if s.span_type == "TOOL"]
    assert [t.inputs["arguments"]["expression"] for t in tools] == ["17*", "17*23"]
    assert [t.outputs["result"] for t in tools] == ["error: invalid syntax", "391"]
    assert [t.status.status_code for t in tools] == ["ERROR", "OK"]
    assert {t.parent_id for t in tools} == {spans["turn 1"].span_id, spans["turn 2"].span_id}
    assert spans["turn 3"].outputs == {"text": "391"}

    single = client.get_trace(ids[1])
    assert [s.name for s in single.data.spans] == ["rollout step 7"]
    assert single.data.spans[0].outputs == {"completion": "4", "reward": 0.0}


@pytest.mark.fast
def test_a_tracking_failure_never_fails_training(caplog):
    from verl_core.train.traces import log_sample_traces

    class Broken:
        def get_run(self, run_id):
            raise ConnectionError("tracking server is down")

    assert log_sample_traces(Broken(), "run", "rollout", 1, [EPISODE]) == []
    assert "could not log 1 rollout samples as MLflow traces: tracking server is down" in caplog.text


@pytest.mark.slow
def test_two_runs_seeded_alike_keep_their_own_traces_and_training_keeps_its_random_stream(tmp_path):
    import random

    from mlflow import MlflowClient

    from verl_core.train.traces import log_sample_traces

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("traces")
    ids = {}
    for name in ("first", "second"):
        run = client.create_run(exp).info.run_id
        random.seed(0)  # what training does (transformers.set_seed)
        ids[name] = log_sample_traces(client, run, "rollout", 1, [EPISODE, EPISODE])
        assert random.random() == random.Random(0).random()  # the stream training sees is untouched
    assert not set(ids["first"]) & set(ids["second"])
    assert len(client.search_traces(locations=[exp], max_results=10)) == 4
