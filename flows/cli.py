"""``verl-core``: run the pipeline, one stage, or the local Prefect + MLflow servers.

    verl-core run   [--config configs/default.yaml] [--set sft.max_steps=150 ...]
    verl-core stage sft|preference_data|reward_model|policy_optimisation|evaluation [--config ...] [--set ...]
    verl-core servers [--prefect-port 4200] [--mlflow-port 5000] [--workdir runs]   # serves runs/mlflow.db
    verl-core config [--config ...] [--set ...]        # print the resolved config
    verl-core serve-reward --reward NAME_OR_PATH --port 8765 [--host 127.0.0.1] [--token T | --token-env VAR]

The command names, stage choices and algorithm list come from the registries
(:data:`verl_core.pipeline.registry.STEPS`, :data:`verl_core.algorithms.registry.ALGORITHMS`).
Prefect is imported by the commands that run flows and by the `flows` package itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tasks.prefect_settings import STARTUP_TIMEOUT_SETTING, quiet_user_error_tracebacks, startup_timeout
from verl_core.algorithms.registry import ALGORITHMS
from verl_core.errors import UserError
from verl_core.pipeline.config import PipelineConfig, load_pipeline_config
from verl_core.pipeline.form import DEFAULT_CONFIG_FILE, config_file_or_default
from verl_core.pipeline.preflight import preflight
from verl_core.pipeline.registry import STAGE_ORDER
from verl_core.pipeline.run_summary import comparison_lines

DEFAULT_CONFIG = Path(DEFAULT_CONFIG_FILE)


def _config(args) -> PipelineConfig:
    return load_pipeline_config(config_file_or_default(args.config), list(args.set or []))


class PrefectStartupError(UserError, RuntimeError):
    """Prefect's temporary local API did not start in time (a busy machine); nothing trained."""


def _quiet_defaults() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from verl_core.train.progress import quiet_library_bars

    quiet_library_bars()  # `make run > log`: lines, not progress-bar frames


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[f"{r.get(k, ''):.4f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(keys), line(["-" * w for w in widths])] + [line(c) for c in cells])


def ui_locations(config: PipelineConfig) -> list[str]:
    from verl_core.pipeline import tracking

    api = os.environ.get("PREFECT_API_URL")
    if api:
        prefect = f"Prefect UI:  {api.rstrip('/').removesuffix('/api')}"
    else:  # the temporary local API kept the run in Prefect's home database, which a started server shows
        from prefect.settings import get_current_settings

        home = get_current_settings().home
        prefect = f"Prefect UI:  `prefect server start` (or `verl-core servers`) shows this run, kept in {home}"
    uri, ui = tracking.tracking_uri(config), tracking.ui_url(config)
    if uri.startswith("http") or _answers(f"{ui}/health"):
        mlflow = f"MLflow UI:   {tracking.experiment_url(config)}"
    else:  # the same store and artifact folder `verl-core servers` serves, on the port the published links use
        port = urllib.parse.urlparse(ui).port or 5000
        artifacts = tracking.artifact_location(config) or ""
        mlflow = (
            f"MLflow UI:   mlflow server --backend-store-uri {uri} --artifacts-destination {artifacts.removeprefix('file://')}"
            f" --host 127.0.0.1 --port {port}  (or `verl-core servers`; then {tracking.experiment_url(config)})"
        )
    return [prefect, mlflow, f"MLflow store: {uri}  experiment: {config.tracking.experiment}"]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _report(result, config: PipelineConfig) -> None:
    print("\nstages:")
    print(
        format_table(
            [
                {"stage": k, "state": v, "output": (result.records[k].output_path if result.records.get(k) else "")}
                for k, v in result.states.items()
            ]
        )
    )
    if result.records.get("evaluation"):
        print("\nevaluation (held-out):")
        print(format_table(result.evaluation_table))
        for line in comparison_lines(result.records["evaluation"].metrics):
            print(line)
    print()
    for line in ui_locations(config):
        print(line)


def _run_flow(args, flow_call) -> int:
    """Check the config in seconds before Prefect starts (the flow checks again under its workdir lock),
    run ``flow_call(config)`` and print what it made."""
    _quiet_defaults()
    config = _config(args)
    preflight(config)
    if args.debug:
        os.environ["VERL_CORE_DEBUG"] = "1"  # Prefect's handlers keep every traceback
    quiet_user_error_tracebacks()
    try:
        result = flow_call(config)
    except RuntimeError as err:
        if "ephemeral Prefect API server" not in str(err):
            raise
        raise PrefectStartupError(
            f"Prefect's temporary local API did not start within {startup_timeout()} s (a busy machine starts it "
            f"slowly); nothing was trained. Raise {STARTUP_TIMEOUT_SETTING} (now {startup_timeout()}), or start "
            "persistent servers with `verl-core servers` and export PREFECT_API_URL"
        ) from None
    _report(result, config)
    return 0


def cmd_run(args) -> int:
    from flows import rlhf_pipeline

    return _run_flow(args, rlhf_pipeline)


def cmd_stage(args) -> int:
    from flows import stage_flow

    return _run_flow(args, lambda config: stage_flow(args.name, config))


def cmd_config(args) -> int:
    import yaml

    print(yaml.safe_dump(_config(args).model_dump(mode="json"), sort_keys=False), end="")
    return 0


# -- local servers --------------------------------------------------------------------------
def launch(cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (so :func:`stop` can end it and its children)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(
        list(cmd), env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_http(url: str, timeout: float = 120, proc: subprocess.Popen | None = None, logs: Sequence[Path] = ()) -> None:
    """Wait until ``url`` answers (any status below 500). If ``proc`` exits first, or the deadline passes,
    the error quotes the last lines of ``logs`` (what the server printed), so a failed start says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode}{log_tails(logs)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status < 500:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s{log_tails(logs)}")


def log_tails(logs: Sequence[Path], lines: int = 30) -> str:
    """The last ``lines`` lines of each existing log, as a block to append to an error message."""
    out = []
    for log in logs:
        if Path(log).is_file():
            tail = Path(log).read_text(errors="replace").splitlines()[-lines:]
            out.append(f"\n--- last {len(tail)} lines of {log} ---\n" + "\n".join(tail))
    return "".join(out)


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM the process group, then SIGKILL it after ``grace`` seconds (Prefect workers ignore SIGTERM)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        pass


def server_commands(workdir: Path, prefect_port: int, mlflow_port: int) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """Command, environment and health URL of the Prefect server and the MLflow server, both on 127.0.0.1.

    The MLflow server serves the store that runs without it write (``<workdir>/mlflow.db``, artifacts
    in ``<workdir>/mlartifacts``: :func:`verl_core.pipeline.tracking.tracking_uri`), so runs logged
    before, during and after the servers are one history, and the links already published resolve."""
    bin_dir = Path(sys.executable).parent
    prefect_env = {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
    }
    return {
        "prefect": (
            [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            prefect_env,
            f"http://127.0.0.1:{prefect_port}/api/health",
        ),
        "mlflow": (
            [
                str(bin_dir / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--backend-store-uri",
                f"sqlite:///{workdir / 'mlflow.db'}",
                "--artifacts-destination",
                str(workdir / "mlartifacts"),
            ],
            {},
            f"http://127.0.0.1:{mlflow_port}/health",
        ),
    }


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_servers(args) -> int:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the servers too
    procs = {}
    try:
        for name, (cmd, env, _health) in server_commands(workdir, args.prefect_port, args.mlflow_port).items():
            (workdir / "servers").mkdir(exist_ok=True)
            procs[name] = launch(cmd, env, workdir / "servers" / f"{name}-server.log")
        for name, (_, _, health) in server_commands(workdir, args.prefect_port, args.mlflow_port).items():
            wait_http(health, timeout=600, proc=procs[name], logs=[workdir / "servers" / f"{name}-server.log"])
        print(f"Prefect UI:  http://127.0.0.1:{args.prefect_port}")
        print(f"MLflow UI:   http://127.0.0.1:{args.mlflow_port}")
        print("In another shell:")
        print(f"  export PREFECT_API_URL=http://127.0.0.1:{args.prefect_port}/api")
        print(f"  export PREFECT_UI_API_URL=http://127.0.0.1:{args.prefect_port}/api  # the UI off port 4200")
        print(f"  export MLFLOW_TRACKING_URI=http://127.0.0.1:{args.mlflow_port}")
        print("  verl-core run")
        print(f"MLflow store: sqlite:///{workdir / 'mlflow.db'} (what `verl-core run` writes without a server)")
        print(f"logs: {workdir}/servers/*-server.log   (Ctrl-C stops both)", flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs.values():
            stop(p)


def cmd_serve_reward(args) -> int:
    """A reward as an HTTP service until Ctrl-C or SIGTERM (:mod:`verl_core.rewards.serve`)."""
    import logging

    from verl_core.config import ConfigError
    from verl_core.rewards.serve import serve_reward

    _quiet_defaults()
    logger = logging.getLogger("verl_core")
    level = logger.level
    logger.setLevel(logging.INFO)  # the judge's first prompt and its parse errors
    token = args.token
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise ConfigError(f"--token-env {args.token_env}: that environment variable is not set")
    before = signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops serving too
    try:
        serve_reward(args.reward, args.host, args.port, token, on_ready=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, before)
        logger.setLevel(level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-core", description="LLM post-training pipeline (Prefect + MLflow)")
    parser.add_argument("--debug", action="store_true", help="print full tracebacks of errors")
    parser.add_argument(
        "--online", action="store_true", help="allow hub downloads (default: offline, HF_HUB_OFFLINE=1, unless already set)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p):
        p.add_argument("--config", type=Path, default=None, help=f"YAML config (default: {DEFAULT_CONFIG} if present)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. --set sft.max_steps=150")

    algorithms = ", ".join(ALGORITHMS)
    p = sub.add_parser("run", help=f"run the whole pipeline (policy_optimisation.algorithm: {algorithms} or none)")
    config_args(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("stage", help="run one stage (and whatever it needs that is not given or cached)")
    p.add_argument("name", choices=STAGE_ORDER)
    config_args(p)
    p.set_defaults(fn=cmd_stage)
    p = sub.add_parser("config", help="print the resolved config")
    config_args(p)
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("servers", help="start local Prefect and MLflow servers on 127.0.0.1")
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--workdir", default="runs", help="the pipeline's workdir, whose MLflow store the server serves")
    p.set_defaults(fn=cmd_servers)
    p = sub.add_parser("serve-reward", help="serve a reward over HTTP: POST /score, GET /health")
    p.add_argument("--reward", required=True, help="reward-model folder, rule name, judge:<model>, or a YAML file")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback only)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", help="require Authorization: Bearer TOKEN on /score")
    token.add_argument("--token-env", metavar="VAR", help="like --token, read from this environment variable")
    p.set_defaults(fn=cmd_serve_reward)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.online:  # a typo in a local path must never start a download
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        return args.fn(args)
    except UserError as err:
        if args.debug:
            traceback.print_exc()
        kind = type(err).__name__
        print(f"verl-core: {kind}: {err}" + ("" if args.debug else "\n(run with --debug for the traceback)"), file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
