"""A reward computed by an HTTP service: ``verl-core serve-reward`` or any service with the same JSON.

``POST <url>`` with ``{"prompts": [...], "completions": [...], "extras": [{"ground_truth": ...}, ...]}``
must answer ``{"scores": [...]}``, one finite number per completion, in order (the contract is in
:mod:`verl_core.rewards.serve`). Rows go ``batch_size`` per request.

Failures never become a silent or missing score: a connection error, a timeout (``timeout_s``) or
a 5xx / 429 answer is retried ``retries`` times, waiting ``backoff_s * 2**attempt`` seconds, and
then raises :class:`~verl_core.rewards.rules.RewardError` naming the URL; another 4xx answer (401:
a wrong token) or an answer that is not that JSON (not JSON, no ``scores``, the wrong count, a
non-number, NaN or inf) raises at once, also naming the URL.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, Optional

from pydantic import Field, SecretStr, field_validator

from verl_core.config import ConfigError, StrictConfig
from verl_core.rewards.rules import RewardError

log = logging.getLogger("verl_core")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class RemoteRewardConfig(StrictConfig):
    """Where the reward service is and how patiently to ask it."""

    url: str = Field(..., description="the scoring endpoint, e.g. http://127.0.0.1:8765/score")
    token_env: Optional[str] = Field(None, description="environment variable holding the bearer token (preferred)")
    token: Optional[SecretStr] = Field(
        None, description="the bearer token itself; written masked, so it does not survive a saved config: prefer token_env"
    )
    timeout_s: float = Field(60.0, gt=0, description="seconds one request may take")
    retries: int = Field(2, ge=0, description="further attempts after a timeout, connection error, 5xx or 429")
    backoff_s: float = Field(1.0, ge=0, description="wait before retry k (0-based): backoff_s * 2**k")
    batch_size: int = Field(64, ge=1, description="rows per request")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got {url!r}")
        return url

    def bearer(self) -> str | None:
        if self.token is not None:
            value = self.token.get_secret_value()
            if value == "**********":  # what a JSON dump of the config (a launch request, a saved config) wrote
                raise ConfigError("remote reward token was masked when its config was written; give it by token_env")
            return value
        if self.token_env:
            value = os.environ.get(self.token_env)
            if not value:
                raise ConfigError(f"remote reward token_env {self.token_env!r} is not set in the environment")
            return value
        return None


class _Retryable(Exception):
    """A failure worth another attempt (timeout, connection, 5xx, 429)."""


class RemoteReward:
    """``RemoteReward(config).score(prompts, completions, ground_truths) -> list[float]``.

    ``metrics()`` gives, since its previous call, ``remote/requests`` (attempts made),
    ``remote/retries``, ``remote/seconds`` (time in requests, waits included) and ``remote/rows``.
    """

    def __init__(self, config: RemoteRewardConfig):
        self.config = config
        self.url = config.url
        self._token = config.bearer()  # a missing token_env fails when the reward is built, not mid-run
        self._reset()

    def _reset(self) -> None:
        self._stats = {"requests": 0, "retries": 0, "seconds": 0.0, "rows": 0}

    def score(self, prompts: Sequence[Any], completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
        if not len(prompts) == len(completions) == len(ground_truths):
            raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(ground_truths)} ground truths")
        bs = self.config.batch_size
        scores: list[float] = []
        t0 = time.perf_counter()
        try:
            for s in range(0, len(completions), bs):
                extras = [{"ground_truth": g} for g in ground_truths[s : s + bs]]
                body = {"prompts": list(prompts[s : s + bs]), "completions": list(completions[s : s + bs]), "extras": extras}
                scores += self._post(body, s)
        finally:
            self._stats["seconds"] += time.perf_counter() - t0
        self._stats["rows"] += len(scores)
        return scores

    def _post(self, body: dict, first_index: int) -> list[float]:
        c = self.config
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        last: Exception | None = None
        for attempt in range(c.retries + 1):
            if attempt:
                self._stats["retries"] += 1
                wait = c.backoff_s * 2 ** (attempt - 1)
                log.warning("remote reward %s: %s; retry %d/%d in %.1f s", self.url, last, attempt, c.retries, wait)
                time.sleep(wait)
            self._stats["requests"] += 1
            try:
                raw = self._request(data, headers)
            except _Retryable as err:
                last = err
                continue
            return self._parse(raw, len(body["completions"]), first_index)
        raise RewardError("remote", None, f"{self.url} failed after {c.retries + 1} attempts: {last}", None)

    def _request(self, data: bytes, headers: dict[str, str]) -> bytes:
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            detail = _snippet(err.read())
            if err.code in RETRY_STATUSES:
                raise _Retryable(f"HTTP {err.code}: {detail}") from None
            hint = " (wrong or missing token)" if err.code == 401 else ""
            raise RewardError("remote", None, f"{self.url} answered HTTP {err.code}{hint}: {detail}", None) from None
        except http.client.HTTPException as err:  # not an HTTP answer (a bad status line, a cut body)
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        except (TimeoutError, OSError) as err:  # URLError, connection refused/reset, socket timeouts
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise _Retryable(f"no answer within timeout_s={self.config.timeout_s} s") from None
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None

    def _parse(self, raw: bytes, n: int, first_index: int) -> list[float]:
        def bad(problem: str, index: int | None = None) -> RewardError:
            where = None if index is None else first_index + index
            return RewardError("remote", where, f"{self.url} {problem}", None)

        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise bad(f"answered something that is not JSON: {_snippet(raw)}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise bad(f'answered without a "scores" list: {_snippet(raw)}')
        if len(scores) != n:
            raise bad(f"answered {len(scores)} scores for {n} completions")
        out = []
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(f"answered a non-number score {value!r}", i)
            if not math.isfinite(value):
                raise bad(f"answered a non-finite score {value}", i)
            out.append(float(value))
        return out

    def metrics(self) -> dict[str, float]:
        """Counters since the previous call (then reset)."""
        out = {f"remote/{k}": float(v) for k, v in self._stats.items()}
        self._reset()
        return out


def _snippet(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
