"""Any reward as a small HTTP service (``verl-core serve-reward``), on the standard library's HTTP server.

    verl-core serve-reward --reward NAME_OR_PATH --port 8765 [--host 127.0.0.1] [--token T | --token-env VAR]

``--reward`` is a trained reward-model folder (a sequence classifier), a rule name of
:data:`~verl_core.rewards.rules.RULE_REWARDS` (``exact_match``, ``numeric_match``, ...),
``judge:<model>`` (a causal LM as yes/no judge with the default question), or a YAML file: a
:class:`~verl_core.rewards.judge.JudgeConfig` (it has a ``model`` key) or a
:class:`~verl_core.rewards.model.RewardSourceConfig` (rules, reward model, judge, remote, with weights).

The JSON contract (what :class:`~verl_core.rewards.remote.RemoteReward` speaks):

``GET /health``
    ``200 {"status": "ok"}`` once the reward is loaded and the service answers (no token needed).
``POST /score``
    Request: ``{"prompts": [...], "completions": [...], "extras": [{...}, ...]}``. A prompt is a string
    or a list of chat messages ``{"role": ..., "content": ...}``; a completion is a string; ``extras``
    (optional) holds one object per row with per-row fields, e.g. ``{"ground_truth": "42"}``.

    Answer: ``200 {"scores": [s_0, s_1, ...]}``, one finite number per completion, in request order.

    Errors answer ``{"error": "<message>"}``: ``400`` a malformed request (not JSON, lists of different
    lengths, wrong types), ``401`` a missing or wrong ``Authorization: Bearer <token>`` (when the service
    has a token), ``404`` another path, ``413`` a body over 64 MiB, ``422`` a row the reward cannot score
    (e.g. a rule that needs a ``ground_truth`` without one), ``500`` anything else.

The service listens on 127.0.0.1 unless another host is given; requests are scored one at a time.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from verl_core.config import ConfigError
from verl_core.errors import UserError
from verl_core.processes import is_loopback
from verl_core.rewards.judge import JudgeConfig, JudgeReward
from verl_core.rewards.model import RewardModel, RewardSource, RewardSourceConfig
from verl_core.rewards.rules import RULE_REWARDS, RewardError

log = logging.getLogger("verl_core")
MAX_BODY = 64 * 2**20


class ServeError(UserError, OSError):
    """The reward service cannot listen where it was asked (port in use, address not available)."""


def load_reward(spec: str) -> RewardSource:
    """The reward ``--reward`` names (see the module docstring), as a :class:`RewardSource`."""
    path = Path(spec).expanduser()
    if spec.startswith("judge:"):
        return RewardSource(judge=JudgeReward(JudgeConfig(model=spec.removeprefix("judge:"))))
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict) and "model" in data:
            return RewardSource(judge=JudgeReward(JudgeConfig.from_yaml(path)))
        return RewardSource.build(RewardSourceConfig.from_yaml(path))
    if path.is_dir():
        config = path / "config.json"
        archs = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ConfigError(
                f"{spec} holds a {archs[0]}, not a reward model (a sequence classifier); to ask it as a judge "
                f"give --reward judge:{spec}"
            )
        return RewardSource(reward_model=RewardModel.from_pretrained(path))
    if spec in RULE_REWARDS:
        return RewardSource(rules={spec: 1.0})
    raise ConfigError(
        f"--reward {spec!r} is neither a reward-model folder, a YAML file, judge:<model>, nor a rule reward "
        f"({', '.join(sorted(RULE_REWARDS))})"
    )


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _rows(body: Any) -> tuple[list, list[str], list[str | None]]:
    """Prompts, completions and ground truths of a ``/score`` request; :class:`_BadRequest` when malformed."""
    if not isinstance(body, dict):
        raise _BadRequest(400, "the request must be a JSON object with prompts and completions")
    prompts, completions, extras = body.get("prompts"), body.get("completions"), body.get("extras")
    if not isinstance(prompts, list) or not isinstance(completions, list):
        raise _BadRequest(400, '"prompts" and "completions" must be lists')
    extras = [{}] * len(completions) if extras is None else extras
    if not isinstance(extras, list) or not all(isinstance(e, dict) for e in extras):
        raise _BadRequest(400, '"extras" must be a list of objects')
    if not len(prompts) == len(completions) == len(extras):
        raise _BadRequest(400, f"{len(prompts)} prompts, {len(completions)} completions and {len(extras)} extras")
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not isinstance(c, str):
            raise _BadRequest(400, f"completion {i} is not a string")
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(m, dict) for m in p))):
            raise _BadRequest(400, f"prompt {i} is neither a string nor a list of messages")
    truths = [e.get("ground_truth") for e in extras]
    return prompts, completions, [None if t is None else str(t) for t in truths]


class _Handler(BaseHTTPRequestHandler):
    server: RewardHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("reward service: " + format, *args)

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/health":
            self._answer(200, {"status": "ok"})
        else:
            self._answer(404, {"error": f"no such path {self.path}; GET /health, POST /score"})

    def do_POST(self) -> None:
        try:
            self._authorise()
            if self.path.split("?")[0] != "/score":
                raise _BadRequest(404, f"no such path {self.path}; POST /score")
            scores = self.server.score(*_rows(self._body()))
            self._answer(200, {"scores": scores})
        except _BadRequest as err:
            self._answer(err.status, {"error": str(err)})
        except (RewardError, ValueError) as err:
            self._answer(422, {"error": str(err)})
        except Exception as err:  # noqa: BLE001 - the client gets the error; the service keeps serving
            log.exception("reward service: scoring failed")
            self._answer(500, {"error": f"{type(err).__name__}: {err}"})

    def _authorise(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise _BadRequest(401, "missing or wrong Authorization: Bearer <token>")

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _BadRequest(411, "a Content-Length header is required") from None
        if length > MAX_BODY:
            raise _BadRequest(413, f"request body of {length} bytes is over {MAX_BODY}")
        try:
            return json.loads(self.rfile.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise _BadRequest(400, f"the request is not JSON: {err}") from None


class RewardHTTPServer(ThreadingHTTPServer):
    """The service: a :class:`RewardSource` behind ``/score`` (one request scored at a time)."""

    daemon_threads = True

    def __init__(self, source: RewardSource | None, host: str = "127.0.0.1", port: int = 8765, token: str | None = None):
        self.source, self.token = source, token or None
        self._lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            super().__init__((host, port), _Handler)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ServeError(f"cannot serve on {host}:{port}: the port is in use; pick another --port") from None
            raise ServeError(f"cannot serve on {host}:{port}: {err.strerror or err}") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def score(self, prompts: list, completions: list[str], truths: list[str | None]) -> list[float]:
        with self._lock:
            return self.source.score(prompts, completions, truths).total.tolist()

    def start(self) -> RewardHTTPServer:
        """Serve in a daemon thread (tests, notebooks); :meth:`close` stops it."""
        threading.Thread(target=self.serve_forever, args=(0.1,), name="reward-service", daemon=True).start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def serve_reward(
    reward: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    on_ready: Callable[[str], None] = print,
) -> None:
    """Serve ``reward`` (see :func:`load_reward`) until interrupted. The port is taken before the reward
    loads, so a port in use fails at once (:class:`ServeError` naming host and port)."""
    server = RewardHTTPServer(None, host, port, token)  # bind first; the source is set once loaded
    try:
        server.source = load_reward(reward)
        if not is_loopback(host):
            log.warning(
                "reward service listens on %s, reachable from other machines%s", host, "" if token else " without a token"
            )
        on_ready(
            f"serving reward {reward} at {server.url}  (POST /score, GET /health{'; bearer token required' if token else ''})"
        )
        server.serve_forever()
    finally:
        server.server_close()
