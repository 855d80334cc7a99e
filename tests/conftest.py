"""Shared fixtures: hermetic caches, the embedded default model, a small trained SFT policy."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="verl-core-tests-"))
# `make test` runs two pytest-xdist workers (one per core): each takes one thread, and so do the processes
# its tests start, since two 2-thread torch processes on 2 cores spin against each other (OpenMP waits).
_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if _THREADS == 1:
    os.environ["OMP_NUM_THREADS"] = "1"
# The workers of one run share what is costly to build and written atomically: the model cache (the tiny
# model, SmolLM2's conversion; renamed into place under a lock) and the session's SFT policy (_build_once).
# The controller (or the only process) owns that folder: the workers it starts inherit its path, and
# pytest_sessionfinish removes each process's own folder (the controller's last, after its workers).
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["VERL_CORE_TESTS_RUN_DIR"] = str(_SESSION_TMP)
_SHARED_TMP = Path(os.environ.get("VERL_CORE_TESTS_RUN_DIR") or _SESSION_TMP)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["VERL_CORE_CACHE"] = str(_SHARED_TMP / "cache")
os.environ["HF_DATASETS_CACHE"] = str(_SESSION_TMP / "hf-datasets")
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")  # before any prefect import
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_SESSION_TMP / 'mlflow.db'}"

from tasks.prefect_settings import apply_defaults  # noqa: E402

apply_defaults()  # the project's Prefect settings, as the CLI has them, before any test imports Prefect

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(_THREADS)
SHARED_DATA = Path(os.environ.get("VERL_CORE_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from verl_core.bundled.tiny_model import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tok(tiny_path):
    from verl_core.modeling.loading import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def pair_examples(tok):
    from verl_core.bundled import arithmetic
    from verl_core.data import tokenize_pairs

    return tokenize_pairs(arithmetic.preference_rows(arithmetic.train_problems(10)), tok, 128)


@pytest.fixture(scope="session")
def small_lm():
    """``build(model_type, vocab_size)``: a 2-layer, hidden-64 causal LM of that transformers family
    (``"llama"``, ``"qwen2"``, ...), seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(model_type: str, vocab_size: int) -> torch.nn.Module:
        torch.manual_seed(0)
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=vocab_size, head_dim=16, **sizes))

    return build


def _build_once(name: str, build) -> Path:
    """``build(folder)`` once per test run, whichever worker asks first; the others wait for it (a file lock).
    The folder is built under a temporary name and renamed, so a failed build leaves nothing to reuse."""
    from verl_core.processes import build_folder_once

    return build_folder_once(_SHARED_TMP / name, build)


@pytest.fixture(scope="session")
def sft_path(tiny_path) -> Path:
    """The default model after 900 SFT steps on the bundled task: exact match ~0.5 on held-out
    problems (room to improve), ~110 s on 2 cores in fp32 (``mixed_precision="no"``).

    Two phases (300 steps of cosine from 3e-3, then 600 at a constant 2e-3), the recipe of
    bench/online_rl.py.
    """
    from verl_core.algorithms.sft import SFTTrainer
    from verl_core.bundled import arithmetic

    def build(out: Path) -> None:
        rows = arithmetic.sft_rows(2000)
        common = dict(train_dataset=rows, batch_size=32, mixed_precision="no", progress=False, logging_steps=100)
        SFTTrainer(
            str(tiny_path), max_steps=300, learning_rate=3e-3, warmup_steps=20, output_dir=str(out / "phase1"), **common
        ).train()
        SFTTrainer(
            str(out / "phase1" / "model"),
            max_steps=600,
            learning_rate=2e-3,
            lr_scheduler="constant",
            output_dir=str(out / "phase2"),
            **common,
        ).train()

    return _build_once("sft", build) / "phase2" / "model"


@pytest.fixture()
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the session (shared by every module that runs flows)."""
    from prefect.testing.utilities import prefect_test_harness

    # a readiness deadline, not a speed claim: 60 s timed out while other jobs kept the 2 cores busy
    with prefect_test_harness(server_startup_timeout=600):
        yield


# Fixtures that train or start servers: a test using one is part of the slow subset.
SLOW_FIXTURES = {"sft_path", "prefect_harness"}


def pytest_sessionfinish(session):
    """A run leaves no folder behind (SmolLM2's conversion alone is 0.5 GB)."""
    import shutil

    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the tests marked exhaustive (more variants of what the suite already covers once)",
    )


def pytest_collection_modifyitems(config, items):
    """``-m 'not slow'`` is the fast subset (about two minutes): tests that train a stage, run a flow
    or start servers are marked ``slow`` by the fixtures they use or by their module's mark.
    Tests marked ``exhaustive`` (further variants of a scenario the suite runs once, kept out so
    that the suite stays under 20 minutes on 2 cores) run with ``--exhaustive``."""
    skip = pytest.mark.skip(reason="a further variant of a covered scenario: run with --exhaustive")
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if "exhaustive" in item.keywords:
            item.add_marker(pytest.mark.slow)
            if not config.getoption("--exhaustive"):
                item.add_marker(skip)


@pytest.fixture()
def one_thread():
    """Tiny models run far faster on one thread when the two cores are shared; afterwards the
    process-wide accelerate state is cleared so the next test's engine may pick its own precision."""
    from accelerate.state import AcceleratorState

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    AcceleratorState._reset_state(reset_partial_state=False)
