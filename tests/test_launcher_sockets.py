"""Every process a one-machine ``torchrun`` or ``ray`` launcher starts listens on loopback only (issue 33).

The slow tests are in tests/test_distributed_stages.py, on the 2-process stages that module runs anyway
(torchrun SFT, Ray DPO; each job starts once per suite): :func:`watch_listeners` runs a stage through
:func:`verl_core.pipeline.launch.run_stage_launched` and, while it runs, polls the listening TCP
sockets of every process it started (the job's whole process tree: torchrun's agent and ranks; the
Ray driver, GCS, raylet, agents, workers). Measured before the change (Ray 2.60, torch 2.13): torchrun's
two c10d stores on ``::``; Ray's GCS, raylet (node manager and object manager), driver and every
worker on ``::``, its autoscaler metrics on ``0.0.0.0``, the runtime-env agent on the machine's
address, and Ray Train's process-group store on ``::``. The fast tests cover the ``bind`` setting.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest

from verl_core.config import ConfigError
from verl_core.pipeline import load_pipeline_config
from verl_core.pipeline.launch import loopback_environment, loopback_tcp_store, torchrun_command
from verl_core.pipeline.launcher_config import LauncherConfig

T = TypeVar("T")


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket bound to IPv4 loopback
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def listeners(pids: set[int], seen: dict, titles: dict) -> None:
    """Add ``(ip, port) -> pid`` for each listening TCP socket of ``pids`` and their descendants, and
    each process's command lines to ``titles`` (Ray workers retitle themselves: IDLE, RayTrainWorker, ...)."""
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
            titles.setdefault(proc.pid, set()).add(" ".join(proc.cmdline())[:160])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                seen.setdefault((c.laddr.ip, c.laddr.port), proc.pid)


def watch_listeners(job: Callable[[], T]) -> tuple[T, dict]:
    """Run ``job`` (a launched stage) in a thread; meanwhile poll the listening TCP sockets of every process it
    started. Returns its result and ``(ip, port) -> "pid N: its command lines"``; the job's own error is raised."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = job()
        except BaseException as err:  # noqa: BLE001  (raised again below, in the test's thread)
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen: dict = {}
    titles: dict = {}
    while thread.is_alive():
        started = {p.pid for p in psutil.Process().children() if p.pid not in before}
        listeners(started, seen, titles)
        time.sleep(0.1)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    named = {addr: f"pid {pid}: {' | '.join(sorted(titles[pid]))}" for addr, pid in seen.items()}
    print("\n".join(f"{ip}:{port}  {who}" for (ip, port), who in sorted(named.items(), key=lambda kv: kv[1])))
    return outcome["result"], named


def assert_loopback_only(seen: dict) -> None:
    off = {f"{ip}:{port}": who for (ip, port), who in seen.items() if not is_loopback(ip)}
    assert not off, "listening off loopback:\n" + "\n".join(f"  {a}  ({w})" for a, w in sorted(off.items()))


@pytest.mark.fast
@pytest.mark.parametrize(
    "settings, loopback",
    [
        ({"kind": "torchrun", "num_processes": 2}, True),
        ({"kind": "ray", "num_processes": 2}, True),
        ({"kind": "torchrun", "num_processes": 2, "rdzv_endpoint": "127.0.0.1:29511"}, True),
        ({"kind": "torchrun", "num_processes": 2, "bind": "network"}, False),
        ({"kind": "torchrun", "num_machines": 2, "rdzv_endpoint": "node0:29400"}, False),
        ({"kind": "ray", "ray_address": "node0:6379"}, False),
    ],
)
def test_bind_defaults_to_loopback_on_one_machine(settings, loopback):
    assert LauncherConfig(**settings).on_loopback is loopback


@pytest.mark.fast
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launcher.kind=torchrun", "launcher.bind=loopback", "launcher.num_machines=2", "launcher.rdzv_endpoint=n:1"], "reach"),
        (["launcher.kind=ray", "launcher.bind=loopback", "launcher.ray_address=node0:6379"], "bind 'network'"),
        (["launcher.kind=torchrun", "launcher.rdzv_endpoint=node0:29400"], "not a loopback address"),
        (["launcher.kind=torchrun", "launcher.bind=all"], "bind"),
    ],
)
def test_a_multi_machine_job_must_say_network(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_pipeline_config(None, overrides)


@pytest.mark.fast
def test_the_loopback_commands_and_environment(tmp_path):
    cmd = torchrun_command(LauncherConfig(kind="torchrun", num_processes=2), tmp_path / "r.json")
    assert cmd[1:4] == ["-m", "verl_core.pipeline.launch", "torch.distributed.run"]
    assert {"--rdzv_endpoint=127.0.0.1:0", "--local_addr=127.0.0.1", "--nnodes=1"} <= set(cmd) and "--standalone" not in cmd
    net = torchrun_command(LauncherConfig(kind="torchrun", num_processes=2, bind="network"), tmp_path / "r.json")
    assert net[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in net
    ray_env = loopback_environment(LauncherConfig(kind="ray", num_processes=2), {})
    assert ray_env["RAY_AUTH_MODE"] == "token" and len(ray_env["RAY_AUTH_TOKEN"]) == 64
    assert ray_env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and ray_env["GLOO_SOCKET_IFNAME"]
    assert "RAY_AUTH_TOKEN" not in loopback_environment(LauncherConfig(kind="ray"), {"RAY_AUTH_MODE": "disabled"})
    assert loopback_environment(LauncherConfig(kind="ray", ray_address="node0:6379"), {}) == {}


@pytest.mark.fast
def test_the_loopback_store_listens_on_127_0_0_1_only():
    import torch.distributed as dist

    store = loopback_tcp_store()
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    mine = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert ("127.0.0.1", store.port) in [(a.ip, a.port) for a in mine]
    assert all(is_loopback(a.ip) for a in mine if a.port == store.port)
