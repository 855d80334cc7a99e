"""Run a training stage where its launcher says: in this process, as a ``torchrun`` job, or on Ray.

:func:`run_stage_launched` is what the Prefect task calls with the stage's plan instead of
:func:`~verl_core.pipeline.runner.run_planned`. For ``torchrun`` and ``ray`` it writes a request
file into the stage folder (``.launch/request.json``), starts the job as a subprocess whose
ranks run :mod:`verl_core.pipeline.worker`, hands every line the job prints to ``log_line`` (the
Prefect task's logger), and reads back the record rank 0 wrote. When any rank fails, it raises
:class:`DistributedStageError` with the failing rank's error and leaves no record (the stage's
checkpoints stay, so the next attempt resumes from the last one).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from verl_core.algorithms.base import FINAL_MODEL_DIR
from verl_core.config import ConfigError
from verl_core.pipeline.launcher_config import LOOPBACK, TRAINING_STEPS, LauncherConfig, launcher_for
from verl_core.pipeline.plan import StagePlan
from verl_core.pipeline.records import HISTORY_FILE, RECORD_FILE, StageOutput, StageRecord, StageResult
from verl_core.pipeline.runner import run_planned
from verl_core.pipeline.worker import ERROR_FILE
from verl_core.train.callbacks import Callback
from verl_core.train.checkpoints import CHECKPOINTS_DIR

log = logging.getLogger("verl_core.launch")
LAUNCH_DIR = ".launch"
REQUEST_FILE = "request.json"
LogLine = Callable[[str], None]


class DistributedStageError(RuntimeError):
    """A rank of a distributed stage failed; the message is that rank's error."""


def run_stage_launched(
    plan: StagePlan,
    callbacks: Sequence[Callback] = (),
    run_id: str | None = None,
    log_line: LogLine | None = None,
) -> StageResult:
    """:func:`run_planned` under the step's launcher (``local``: in this process, with ``callbacks``).

    Distributed, rank 0 reports to the MLflow run ``run_id`` itself; ``callbacks`` (in-process
    objects) cannot follow the job and are not called.
    """
    config, name, out_dir = plan.config, plan.name, plan.out_dir
    launcher = launcher_for(config, name)
    record_file = out_dir / RECORD_FILE
    # in this process; or the complete output already there, which run_planned reuses without training
    if launcher.kind == "local" or name not in TRAINING_STEPS or record_file.is_file():
        return run_planned(plan, callbacks=callbacks, run_id=run_id)
    check_launchable(launcher)
    launch_dir = out_dir / LAUNCH_DIR
    launch_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*launch_dir.glob("rank-*"), *launch_dir.glob(".tmp-*")]:
        stale.unlink()
    request = launch_dir / REQUEST_FILE
    payload = {"plan": plan.to_request(), "run_id": run_id, "threads": launcher.threads_per_process}
    request.write_text(json.dumps(payload))
    command = torchrun_command(launcher, request) if launcher.kind == "torchrun" else ray_command(launcher, request)
    env = rank_environment(launcher)
    say = log_line or log.info
    say(f"{name}: {launcher.kind} with {launcher.world_size} processes: {' '.join(command)}")
    code, tail = stream(command, env, say, launcher.timeout_seconds)
    if code != 0 or not record_file.is_file():
        remove_partial_output(out_dir)
        where = f"stage {name!r} ({launcher.kind}, {launcher.world_size} processes)"
        raise DistributedStageError(f"{where}: {failure(launch_dir, code, tail)}")
    shutil.rmtree(launch_dir, ignore_errors=True)  # kept on failure: the request and each rank's error
    record = StageRecord.model_validate_json(record_file.read_text())
    hist = out_dir / HISTORY_FILE
    history = json.loads(hist.read_text()) if hist.is_file() else {}
    return StageResult(record, StageOutput(Path(record.output_path), record.metrics, history))


def remove_partial_output(out_dir: Path) -> None:
    """What a killed rank can leave behind: a record written before another rank failed (the stage
    is not done), a model or checkpoint folder still under its temporary name. Complete
    checkpoints stay for the next attempt to resume from."""
    (out_dir / RECORD_FILE).unlink(missing_ok=True)
    for partial in [*out_dir.glob(f".{FINAL_MODEL_DIR}-*"), *(out_dir / CHECKPOINTS_DIR).glob(".tmp-*")]:
        shutil.rmtree(partial, ignore_errors=True)


def torchrun_command(launcher: LauncherConfig, request: Path) -> list[str]:
    """``python -m torch.distributed.run ... -m verl_core.pipeline.worker REQUEST``.

    On loopback (``launcher.on_loopback``) the agent is ``python -m verl_core.pipeline.launch
    torch.distributed.run ...`` (:func:`torchrun_on_loopback`): torchrun with the same arguments whose
    c10d stores listen on 127.0.0.1, with its rendezvous on 127.0.0.1 (a free port) and the ranks'
    ``MASTER_ADDR`` 127.0.0.1. Plain torchrun binds its stores on every interface whatever the endpoint
    (``--standalone`` too)."""
    nproc = ["--nproc_per_node", str(launcher.num_processes)]
    if launcher.on_loopback:
        port = launcher.rdzv_endpoint.rsplit(":", 1)[1] if launcher.rdzv_endpoint else "0"  # 0: a free port
        cmd = [sys.executable, "-m", "verl_core.pipeline.launch", "torch.distributed.run", *nproc, "--nnodes=1"]
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={LOOPBACK}:{port}", f"--local_addr={LOOPBACK}"]
    elif launcher.num_machines == 1 and launcher.rdzv_endpoint is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", *nproc, "--standalone"]  # a free port, on every interface
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *nproc]
        cmd += [
            f"--nnodes={launcher.num_machines}",
            f"--node_rank={launcher.machine_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={launcher.rdzv_endpoint}",
        ]
    return cmd + ["-m", "verl_core.pipeline.worker", str(request)]


def ray_command(launcher: LauncherConfig, request: Path) -> list[str]:
    """``python -m verl_core.pipeline.ray_job REQUEST`` (a Ray driver in its own process)."""
    return [sys.executable, "-m", "verl_core.pipeline.ray_job", str(request)]


def rank_environment(launcher: LauncherConfig) -> dict[str, str]:
    """The job's environment: this one, the project importable, the launcher's threads and ``env``,
    and the variables ``accelerate launch`` would derive from ``accelerate_config``."""
    import verl_core

    env = dict(os.environ)
    root = str(Path(verl_core.__file__).resolve().parents[1])  # the same verl_core as this process
    env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    env["OMP_NUM_THREADS"] = str(launcher.threads_per_process)
    env["TQDM_DISABLE"] = "1"  # progress bars redraw with \r: noise in a task log
    env["PYTHONUNBUFFERED"] = "1"
    env["RAY_COLOR_PREFIX"] = "0"  # plain "(RayTrainWorker pid=...)" prefixes, no colour codes
    env.update(loopback_environment(launcher, env))
    if launcher.accelerate_config is not None:
        from verl_core.pipeline.accelerate_env import accelerate_environment, sharding_unavailable_reason

        derived = accelerate_environment(launcher)
        reason = sharding_unavailable_reason(derived)
        if reason is not None:
            raise ConfigError(f"launcher.accelerate_config {launcher.accelerate_config}: {reason}")
        env.update(derived)
    env.update(launcher.env)
    return env


def loopback_environment(launcher: LauncherConfig, env: dict[str, str]) -> dict[str, str]:
    """What keeps a job on 127.0.0.1 (nothing when ``launcher.on_loopback`` is false): gloo and NCCL
    sockets on the loopback interface; for a local Ray cluster, its node IP 127.0.0.1 and Ray's token
    authentication with a fresh token (unless ``env`` already sets ``RAY_AUTH_MODE``). Measured with Ray
    2.60: the GCS, raylet, object manager and workers listen on 127.0.0.1 when the node IP is loopback
    and on every interface otherwise, and on Linux ``ray.init(_node_ip_address="127.0.0.1")`` is turned
    into the machine's address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ray is imported)."""
    if not launcher.on_loopback:
        return {}
    lo = loopback_interface()
    out = {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    if launcher.kind == "ray":
        out["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if "RAY_AUTH_MODE" not in env:
            out["RAY_AUTH_MODE"] = "token"
            out["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # the job's processes inherit it; nothing on disk
    return out


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux)."""
    import socket

    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), "lo"))


def loopback_tcp_store(port: int = 0, **kwargs):
    """A ``torch.distributed.TCPStore`` server on 127.0.0.1:``port`` only (0: a free port; ``.port`` says which)."""
    return loopback_store_class()(LOOPBACK, port, is_master=True, **kwargs)


@functools.cache
def loopback_store_class():
    """``torch.distributed.TCPStore`` whose server listens on 127.0.0.1 only. TCPStore binds its
    server on every interface and takes no bind address, but it accepts a listening socket
    (``master_listen_fd``): this subclass binds one on 127.0.0.1. A taken port raises ``RuntimeError``,
    as TCPStore does (torchrun's rendezvous then joins the store as a client)."""
    import socket

    from torch.distributed import TCPStore

    class LoopbackTCPStore(TCPStore):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            if is_master and len(args) < 4 and kwargs.get("master_listen_fd") is None:  # args[3]: master_listen_fd
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((LOOPBACK, port))
                    sock.listen(socket.SOMAXCONN)
                except OSError as err:
                    sock.close()
                    raise RuntimeError(f"cannot listen on {LOOPBACK}:{port}: {err}") from err
                port, kwargs["master_listen_fd"] = sock.getsockname()[1], sock.detach()
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    return LoopbackTCPStore


def torchrun_on_loopback(argv: list[str]) -> None:
    """torchrun (``torch.distributed.run.main(argv)``) whose TCPStore servers listen on 127.0.0.1:
    the c10d rendezvous store and the store the agent shares with the ranks. torch offers no bind
    address for either, so ``torch.distributed.TCPStore`` is replaced in this agent process (not in
    the ranks) by a subclass that hands TCPStore a socket bound to 127.0.0.1."""
    import torch.distributed as dist
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    loopback = loopback_store_class()
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        module.TCPStore = loopback
    run.main(argv)


def stream(command: list[str], env: dict[str, str], log_line: LogLine, timeout: float | None) -> tuple[int, list[str]]:
    """Run ``command`` in its own process group, each output line to ``log_line``; (exit code, last lines).
    The group is killed on timeout and when this process is interrupted."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )
    tail: collections.deque[str] = collections.deque(maxlen=200)
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout, on_timeout) if timeout else None
    if timer:
        timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log_line(line)
        code = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        if timer:
            timer.cancel()
    if timed_out.is_set():
        tail.append(f"the job was killed after its timeout of {timeout} s (launcher.timeout_seconds)")
    return code, list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def failure(launch_dir: Path, code: int, tail: list[str]) -> str:
    """The failing rank's error: a rank killed by a signal other than torchrun's own SIGTERM (it
    leaves no error file, and the others then fail in a collective), else the first error file
    written, else what torchrun's summary says."""
    ended = _ranks_ended_by_signal(tail)
    errors = sorted((json.loads(p.read_text()) for p in launch_dir.glob(ERROR_FILE.format(rank="*"))), key=lambda e: e["time"])
    killed = [(r, sig) for r, sig in ended if sig != "SIGTERM"]
    if killed:
        r, sig = killed[0]
        then = "".join(f"; then rank {e['rank']}: {e['type']}: {_first_line(e['message'])}" for e in errors if e["rank"] != r)
        return f"rank {r} was killed by {sig}{then}"
    if errors:
        e = errors[0]
        last = e["traceback"].strip().splitlines()[-6:]
        return f"rank {e['rank']} failed: {e['type']}: {e['message']}\n" + "\n".join(last)
    if ended:
        return f"rank {ended[0][0]} was killed by {ended[0][1]}"
    return f"the job exited with code {code} and no rank reported an error; its last lines:\n" + "\n".join(tail[-20:])


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _ranks_ended_by_signal(tail: list[str]) -> list[tuple[int, str]]:
    """(rank, signal name) of each rank torchrun's failure summary reports as ended by a signal."""
    out = []
    for block in re.split(r"^\s*\[\d+\]:\s*$", "\n".join(tail), flags=re.M)[1:]:
        rank_ = re.search(r"^\s*rank\s*:\s*(\d+)", block, re.M)
        exitcode = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", block, re.M)
        if rank_ and exitcode and int(exitcode.group(1)) < 0:
            try:
                name = signal.Signals(-int(exitcode.group(1))).name
            except ValueError:
                name = f"signal {-int(exitcode.group(1))}"
            out.append((int(rank_.group(1)), name))
    return out


def check_launchable(launcher: LauncherConfig) -> None:
    """Fail early, naming the setting, when a launcher cannot start here."""
    if launcher.accelerate_config is not None and not Path(launcher.accelerate_config).is_file():
        raise ConfigError(f"launcher.accelerate_config: file not found: {launcher.accelerate_config}")
    if launcher.kind == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("launcher.kind 'ray' needs Ray: pip install 'verl_core[ray]'") from None


if __name__ == "__main__":
    if sys.argv[1:2] != ["torch.distributed.run"]:
        print("usage: python -m verl_core.pipeline.launch torch.distributed.run TORCHRUN_ARGS...", file=sys.stderr)
        sys.exit(2)
    torchrun_on_loopback(sys.argv[2:])
