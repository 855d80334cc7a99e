"""Rewards over HTTP: the service (`verl-core serve-reward`), its JSON contract and token, the client's
batching, retries and checks, and GRPO runs against a real service, a stalling one and a garbage one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from verl_core.rewards import RemoteReward, RemoteRewardConfig, RewardError
from verl_core.rewards.rules import exact_match
from verl_core.rewards.serve import RewardHTTPServer, ServeError, load_reward

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = [" 3 + 4 = 7\n#### 7", "#### 6", " 2", "#### 12", " 5"]
TRUTHS = ["7", "7", "2", "12", "4"]
PROMPTS = ["Q: 3 + 4?", "Q: 9 - 2?", [{"role": "user", "content": "1+1?"}], "Q: 6 * 2?", "Q: 2 + 2?"]


@contextmanager
def reward_service(reward: str = "exact_match", token: str | None = None):
    server = RewardHTTPServer(load_reward(reward), "127.0.0.1", 0, token).start()
    try:
        yield server
    finally:
        server.close()


def _post(url: str, payload, headers: dict | None = None) -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class _StubHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            index = self.server.count
            self.server.count += 1
        status, data, delay = self.server.respond(index, body)
        time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (a stall past its timeout)
            pass

    def log_message(self, *args):
        pass


@contextmanager
def stub_service(respond):
    """Any service: ``respond(request_index, body) -> (status, bytes, delay_s)``; yields (url, server)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    server.daemon_threads = True
    server.respond, server.count, server.lock = respond, 0, threading.Lock()
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", server
    finally:
        server.shutdown()
        server.server_close()


def _fine(index, body):
    return 200, json.dumps({"scores": [0.5] * len(body["completions"])}).encode(), 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_service_answers_health_and_scores_in_request_order_and_the_client_batches():
    with reward_service("exact_match") as server:
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
        extras = [{"ground_truth": t} for t in TRUTHS]
        status, answer = _post(f"{server.url}/score", {"prompts": PROMPTS, "completions": COMPLETIONS, "extras": extras})
        assert status == 200 and answer == {"scores": exact_match(COMPLETIONS, TRUTHS)} == {"scores": [1, 0, 1, 1, 0]}
        client = RemoteReward(RemoteRewardConfig(url=f"{server.url}/score", batch_size=2))
        assert client.score(PROMPTS, COMPLETIONS, TRUTHS) == [1.0, 0.0, 1.0, 1.0, 0.0]
        metrics = client.metrics()
        assert metrics["remote/requests"] == 3 and metrics["remote/rows"] == 5 and metrics["remote/retries"] == 0
        assert metrics["remote/seconds"] > 0 and client.metrics()["remote/requests"] == 0  # reset after reading


def test_malformed_requests_are_answered_with_4xx_and_a_message():
    with reward_service("exact_match") as server:
        url = f"{server.url}/score"
        assert _post(url, b"{not json")[0] == 400
        status, answer = _post(url, {"prompts": ["a"], "completions": ["b", "c"]})
        assert status == 400 and "1 prompts, 2 completions" in answer["error"]
        status, answer = _post(url, {"prompts": ["a"], "completions": ["b"]})  # exact_match needs a ground truth
        assert status == 422 and "needs a ground truth" in answer["error"]
        assert _post(f"{server.url}/other", {"prompts": [], "completions": []})[0] == 404
        assert _post(url, {"prompts": [], "completions": []}) == (200, {"scores": []})
    with reward_service("format") as server:  # a rule without ground truths: extras may be left out
        assert _post(f"{server.url}/score", {"prompts": ["q", "q"], "completions": ["#### 4", "4"]}) == (200, {"scores": [1, 0]})


def test_a_service_with_a_token_refuses_requests_without_it(monkeypatch):
    with reward_service("format", token="s3cret") as server:
        url = f"{server.url}/score"
        rows = {"prompts": ["q"], "completions": ["#### 4"]}
        assert _post(url, rows)[0] == 401
        assert _post(url, rows, {"Authorization": "Bearer wrong"})[0] == 401
        assert _post(url, rows, {"Authorization": "Bearer s3cret"}) == (200, {"scores": [1]})
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as resp:
            assert resp.status == 200  # readiness probes need no token
        with pytest.raises(RewardError, match=rf"{url} answered HTTP 401 \(wrong or missing token\)"):
            RemoteReward(RemoteRewardConfig(url=url)).score(["q"], ["#### 4"], [None])
        monkeypatch.setenv("REWARD_TOKEN", "s3cret")
        config = RemoteRewardConfig(url=url, token_env="REWARD_TOKEN")
        assert RemoteReward(config).score(["q"], ["#### 4"], [None]) == [1.0]
        assert "s3cret" not in json.dumps(RemoteRewardConfig(url=url, token="s3cret").model_dump(mode="json"))
    monkeypatch.delenv("REWARD_TOKEN")
    with pytest.raises(Exception, match="token_env 'REWARD_TOKEN' is not set"):
        RemoteReward(config)


def test_a_port_in_use_is_a_clear_error_naming_it(capsys):
    from flows.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServeError, match=f"cannot serve on 127.0.0.1:{port}: the port is in use"):
            RewardHTTPServer(load_reward("format"), "127.0.0.1", port)
        before = signal.getsignal(signal.SIGTERM)
        assert main(["serve-reward", "--reward", "format", "--port", str(port)]) == 1
        assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert f"verl-core: ServeError: cannot serve on 127.0.0.1:{port}: the port is in use" in err
    assert main(["serve-reward", "--reward", "no_such_rule", "--port", str(_free_port())]) == 2
    assert "is neither a reward-model folder, a YAML file, judge:<model>, nor a rule reward" in capsys.readouterr().err


def test_a_stalling_or_unreachable_service_fails_after_the_retries_naming_the_url():
    with stub_service(lambda i, body: (200, b'{"scores": [1.0]}', 2.0)) as (url, server):
        client = RemoteReward(RemoteRewardConfig(url=url, timeout_s=0.3, retries=2, backoff_s=0.05))
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=rf"{url} failed after 3 attempts: no answer within timeout_s=0.3 s"):
            client.score(["q"], ["a"], [None])
        assert time.monotonic() - t0 < 1.8  # three timeouts and two short waits, not the stall itself
        assert server.count == 3
        metrics = client.metrics()
        assert metrics["remote/requests"] == 3 and metrics["remote/retries"] == 2
    url = f"http://127.0.0.1:{_free_port()}/score"  # nobody listens
    with pytest.raises(RewardError, match=rf"{url} failed after 2 attempts: .*(refused|Errno)"):
        RemoteReward(RemoteRewardConfig(url=url, retries=1, backoff_s=0)).score(["q"], ["a"], [None])


def test_a_server_error_is_retried_and_then_the_answer_is_used():
    answers = [(503, b"busy", 0.0), (200, b'{"scores": [0.25, 0.75]}', 0.0)]
    with stub_service(lambda i, body: answers[i]) as (url, server):
        client = RemoteReward(RemoteRewardConfig(url=url, retries=2, backoff_s=0.01))
        assert client.score(["q", "q"], ["a", "b"], [None, None]) == [0.25, 0.75]
        assert client.metrics()["remote/retries"] == 1 and server.count == 2


@pytest.mark.parametrize(
    "answer, problem",
    [
        (b"<html>proxy error</html>", "answered something that is not JSON"),
        (b'{"result": [1, 2]}', 'answered without a "scores" list'),
        (b'{"scores": [1.0]}', "answered 1 scores for 2 completions"),
        (b'{"scores": [1.0, NaN]}', "answered a non-finite score nan"),  # on sample 1
        (b'{"scores": [1.0, "high"]}', "answered a non-number score 'high'"),
        (b'{"scores": [true, 1.0]}', "answered a non-number score True"),
    ],
)
def test_garbage_answers_raise_at_once_naming_the_url(answer, problem):
    with stub_service(lambda i, body: (200, answer, 0.0)) as (url, server):
        client = RemoteReward(RemoteRewardConfig(url=url, retries=3, backoff_s=0.01))
        with pytest.raises(RewardError, match=f"reward 'remote' failed .*{url}.*{problem}") as err:
            client.score(["q", "q"], ["a", "b"], [None, None])
        assert url in str(err.value) and server.count == 1  # not retried: the same request gets the same garbage


def _grpo(tiny_path, tmp_path, remote: dict, **overrides):
    from verl_core.algorithms.grpo import GRPOTrainer

    settings = dict(batch_size=8, num_generations=4, max_steps=2, max_new_tokens=8, learning_rate=1e-4, progress=False)
    settings.update(overrides)
    return GRPOTrainer(policy=str(tiny_path), remote=remote, logging_steps=1, output_dir=str(tmp_path / "out"), **settings)


@pytest.mark.slow
def test_grpo_trains_against_the_service_started_by_the_cli(tiny_path, tmp_path, monkeypatch):
    port = _free_port()
    env = {**os.environ, "SERVE_TOKEN": "t0ken", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flows.cli", "serve-reward", "--reward", "format", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--token-env", "SERVE_TOKEN"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ready = proc.stdout.readline()  # printed once the reward is loaded and the port taken
        assert f"serving reward format at http://127.0.0.1:{port}" in ready, ready + proc.stdout.read()
        monkeypatch.setenv("REWARD_TOKEN", "t0ken")
        trainer = _grpo(tiny_path, tmp_path, {"url": f"http://127.0.0.1:{port}/score", "token_env": "REWARD_TOKEN"})
        assert trainer.rewards.rules == {}  # the service is the reward: the default rules do not apply
        result = trainer.train()
        assert result.metrics["remote/requests"] == 1 and result.metrics["remote/retries"] == 0
        assert result.metrics["remote/rows"] == 8 and 0.0 <= result.metrics["reward/remote"] <= 1.0
        assert result.output_dir is not None and Path(result.output_dir).is_dir()
    finally:
        proc.terminate()  # SIGTERM: the CLI stops serving and exits 0
        assert proc.wait(timeout=30) == 0


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["stall", "garbage"])
def test_a_service_failing_mid_run_stops_it_before_any_step_trains_on_a_missing_score(tiny_path, tmp_path, failure):
    from verl_core.train.callbacks import Callback

    class Updates(Callback):
        steps: list[int] = []

        def on_update(self, step, metrics):
            self.steps.append(step)

    def respond(index, body):  # the first rollout step is scored, the second is not
        if index == 0:
            return _fine(index, body)
        return (200, b'{"scores": [1.0, 2.0]}', 0.0) if failure == "garbage" else (200, b"{}", 2.0)

    updates = Updates()
    with stub_service(respond) as (url, server):
        remote = {"url": url, "timeout_s": 0.3, "retries": 1, "backoff_s": 0.05}
        trainer = _grpo(tiny_path, tmp_path, remote, max_steps=3, callbacks=[updates])
        with pytest.raises(RewardError, match=url):
            trainer.train()
    assert updates.steps and all(step == updates.steps[0] for step in updates.steps)  # only the first step updated
    assert not (tmp_path / "out" / "model").exists()  # no final model from a failed run
