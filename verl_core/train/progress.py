"""Progress that suits where it is shown: a live bar on a terminal, periodic lines in a log.

Off a terminal (``make run > log``, a Prefect worker, CI) a carriage-return bar writes a frame per
update into the file; there :func:`progress_bar` prints one plain line every ``interval`` seconds
(and at the end) instead, and :func:`quiet_library_bars` turns off the bars of ``transformers``
and ``datasets`` (loading weights, writing shards, generating splits).

The same lines go to the logger ``verl_core.progress`` when logging is set up for it (the pipeline's
Prefect tasks attach Prefect's handlers to ``verl_core``, so they reach the run's log in the UI while a
stage trains); they are then logged instead of printed, so a worker's terminal shows each line once. A
long run stays readable: after every :data:`LINES_PER_DOUBLING` lines the interval doubles.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

# seconds between two lines off a terminal (env override for long jobs)
LINE_INTERVAL_S = float(os.environ.get("VERL_CORE_PROGRESS_INTERVAL", "30"))
LINES_PER_DOUBLING = 50
log = logging.getLogger("verl_core.progress")


def _logged() -> bool:
    """Whether progress lines have a logging destination of their own to go to: handlers attached to the
    ``verl_core`` logger (Prefect's, in a pipeline task; or the user's), not merely the root logger's."""
    project = logging.getLogger("verl_core")
    return bool(project.handlers or log.handlers) and log.isEnabledFor(logging.INFO)


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
        print_lines: bool = True,
    ):
        self.total, self.n, self.desc, self.unit, self.disable = total, initial, desc, unit, disable
        self.print_lines = print_lines  # False: only logged (a terminal's tqdm bar shows the progress)
        self.lines = 0
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
        line = f"{self.desc}: {done} {self.unit}s{pct} {rate:.2f} s/{self.unit}{extra}"
        self.lines += 1
        if self.lines % LINES_PER_DOUBLING == 0:
            self.interval *= 2
        if _logged():
            log.info(line)
        elif self.print_lines:
            print(line, file=self.file, flush=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int | None, initial: int = 0, desc: str = "", unit: str = "step", disable: bool = False):
    """A tqdm bar on a terminal, else a :class:`LineProgress`."""
    if on_terminal():
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=disable, dynamic_ncols=True)
        return _TerminalProgress(bar, LineProgress(total, initial, desc, unit, disable, print_lines=False))
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


class _TerminalProgress:
    """A tqdm bar for the eye, and the periodic lines for a log that is listening (a Prefect run's)."""

    def __init__(self, bar: Any, lines: LineProgress):
        self.bar, self.lines = bar, lines

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        self.lines.update(n)

    def set_postfix(self, values: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.bar.set_postfix(values, **kwargs)
        self.lines.set_postfix(values, **kwargs)

    def close(self) -> None:
        self.bar.close()
        self.lines.close()

    def __enter__(self) -> _TerminalProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
