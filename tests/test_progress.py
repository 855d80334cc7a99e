"""Progress off a terminal: periodic single lines, never carriage-return frames."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from verl_core.train.progress import LineProgress, progress_bar

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def printed(monkeypatch):
    """Lines printed, not logged: in the suite the project's logger may have Prefect's handlers attached."""
    from verl_core.train import progress

    monkeypatch.setattr(progress, "_logged", lambda: False)


def test_line_progress_prints_one_line_per_interval_and_a_last_line(printed):
    out = io.StringIO()
    bar = LineProgress(total=100, desc="train", interval=0.0, file=out)
    bar.set_postfix({"loss": "0.5"})
    for _ in range(3):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()  # close() adds nothing after the last update's line
    assert lines[-1].startswith("train: 3/100 steps (3%)") and lines[-1].endswith("loss=0.5")
    quiet = io.StringIO()
    bar = LineProgress(total=100, desc="train", interval=3600, file=quiet)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert quiet.getvalue().count("\n") == 1 and quiet.getvalue().startswith("train: 100/100 steps (100%)")


def test_training_with_redirected_output_writes_lines_not_bar_frames(tmp_path):
    """A short SFT run whose stdout and stderr go to a file (like ``make run > log 2>&1``)."""
    script = (
        "from verl_core import SFTTrainer, arithmetic, tiny_model_path\n"
        "SFTTrainer(tiny_model_path(), train_dataset=arithmetic.sft_rows(64), max_steps=5, batch_size=8,"
        f" mixed_precision='no', output_dir={str(tmp_path / 'sft')!r}).train()\n"
    )
    log = tmp_path / "log"
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=300)
    text = log.read_text()
    assert "\r" not in text, text[-2000:]
    assert "SFTTrainer: 5/5 steps (100%)" in text  # the trainer names its lines (SFT and the reward model read apart)


def test_a_terminal_gets_a_tqdm_bar(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = progress_bar(10, desc="x", disable=True)
    assert type(bar.bar).__module__.startswith("tqdm")  # beside it, the lines a listening log gets (none here)
    bar.close()


def test_a_long_run_logs_a_bounded_number_of_lines(monkeypatch, printed):
    """The interval doubles every LINES_PER_DOUBLING lines: a 10-hour run at 30 s gives ~250 lines, not 1,200."""
    from verl_core.train import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = LineProgress(total=36_000, desc="train", interval=30.0, file=out)
    for _ in range(36_000):  # a step a second for ten hours
        clock[0] += 1.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 150 < len(lines) < 300 and lines[-1].startswith("train: 36000/36000 steps (100%)")


def test_progress_lines_are_logged_not_printed_when_the_project_logger_has_a_handler(monkeypatch):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    project = logging.getLogger("verl_core")
    monkeypatch.setattr(project, "handlers", [handler])
    level = project.level
    project.setLevel(logging.INFO)
    try:
        out = io.StringIO()
        bar = LineProgress(total=3, desc="SFTTrainer", interval=0.0, file=out)
        bar.update(3)
        bar.close()
    finally:
        project.setLevel(level)
    assert out.getvalue() == "" and records[-1].getMessage().startswith("SFTTrainer: 3/3 steps (100%)")
