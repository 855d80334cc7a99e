"""Progress that suits where it is shown: a live bar on a terminal, periodic lines in a log.

Off a terminal (``make run > log``, a Prefect worker, CI) a carriage-return bar writes a frame per
update into the file; there :func:`progress_bar` prints one plain line every ``interval`` seconds
(and at the end) instead, and :func:`quiet_library_bars` turns off the bars of ``transformers``
and ``datasets`` (loading weights, writing shards, generating splits).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

# seconds between two lines off a terminal (env override for long jobs)
LINE_INTERVAL_S = float(os.environ.get("VERL_CORE_PROGRESS_INTERVAL", "30"))


def on_terminal() -> bool:
    """True when both stdout and stderr are terminals (a redirected stream is a log file)."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class LineProgress:
    """tqdm's small interface (``update``, ``set_postfix``, ``close``, context manager) as lines:
    ``train: 40/100 steps (40%) 2.1 s/step loss=0.53``, at most one per ``interval`` seconds."""

    def __init__(
        self,
        total: int | None,
        initial: int = 0,
        desc: str = "",
        unit: str = "step",
        disable: bool = False,
        interval: float | None = None,
        file: TextIO | None = None,
    ):
        self.total, self.n, self.desc, self.unit, self.disable = total, initial, desc, unit, disable
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.file = file or sys.stderr
        self.postfix: dict[str, Any] = {}
        self._start, self._start_n = time.monotonic(), initial
        self._last_line = self._start
        self._printed_at: int | None = None

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last_line >= self.interval:
            self._line(now)

    def set_postfix(self, values: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.postfix = {**(values or {}), **kwargs}

    def close(self) -> None:
        if self._printed_at != self.n:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self._last_line, self._printed_at = now, self.n
        if self.disable:
            return
        done = f"{self.n}/{self.total}" if self.total else str(self.n)
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = (now - self._start) / max(1, self.n - self._start_n)
        extra = "".join(f" {k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: {done} {self.unit}s{pct} {rate:.2f} s/{self.unit}{extra}", file=self.file, flush=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int | None, initial: int = 0, desc: str = "", unit: str = "step", disable: bool = False):
    """A tqdm bar on a terminal, else a :class:`LineProgress`."""
    if on_terminal():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable, dynamic_ncols=True)
    quiet_library_bars()  # e.g. "Writing model shards" when the trainer saves
    return LineProgress(total, initial, desc, unit, disable)


def quiet_library_bars() -> None:
    """Off a terminal: no progress bars from transformers, datasets or the Hugging Face hub."""
    if on_terminal():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - both are dependencies
        pass
