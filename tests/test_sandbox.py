"""The sandbox for model-written Python: normal programs run, hostile ones are contained.

Every hostile case checks three things: the result's status and reason, that nothing escaped
(no file written, no connection made, no secret printed, no process left behind), and that the
test process is unharmed (the next run works). Time limits are generous (limit + 10 s): the
machine may be loaded, and only containment, not speed, is under test.

Hostile cases take the ``audit`` fixture: they run with the audit hook on (``run_python``) and
off (``runner._run(..., audit=False)``), where only the kernel layers (namespaces, mounts, uid,
rlimits) contain them; the status is then the program's own (an OSError is "error"), and only
containment is checked. The hook-off runs are skipped where the machine gives no mount namespace.
"""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_core.config import ConfigError
from verl_core.sandbox import runner as sandbox
from verl_core.sandbox.runner import SandboxLimits, SandboxResult, run_many, run_python, sandbox_isolation

pytestmark = pytest.mark.fast

SLACK_S = 10.0  # on top of a time limit, for a loaded machine
QUICK = SandboxLimits(timeout_s=3, cpu_s=3, memory_mb=256)
SHOW_FOLDER = "import os\nprint(os.getcwd(), flush=True)\n"  # hostile programs first print their folder


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a run's folder is in its child's argv)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _assert_nothing_left(result: SandboxResult) -> None:
    folder = result.stdout.split("\n", 1)[0].strip()
    assert folder.startswith("/") and folder.endswith("/work"), result
    deadline = time.monotonic() + 5
    while _processes_mentioning(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(folder) == [], "processes of the run are still alive"
    assert not Path(folder).exists() and not Path(folder).parent.exists(), "the run's folder was not removed"


def _assert_still_works() -> None:
    result = run_python("print('still', 6 * 7)")
    assert (result.status, result.stdout) == ("ok", "still 42\n"), result


@pytest.fixture(params=[True, False], ids=["hook_on", "hook_off"])
def audit(request) -> bool:
    """Run a hostile case with the audit hook on, and off (the kernel layers alone)."""
    iso = sandbox_isolation()
    if not request.param and not (iso.namespaces and iso.mounts):
        pytest.skip(f"without the hook only the kernel layers contain a program; here they are weak: {iso.describe()}")
    return request.param


def _timed(code: str, limits: SandboxLimits = QUICK, audit: bool = True, **kwargs) -> SandboxResult:
    start = time.monotonic()
    if audit:
        result = run_python(code, limits, **kwargs)
    else:
        result = sandbox._run(code, limits, kwargs.get("stdin", ""), sandbox_isolation(), audit=False)
    assert time.monotonic() - start < limits.timeout_s + SLACK_S, result
    return result


def test_a_normal_program_returns_its_output_and_ok():
    result = run_python("import sys\nname = input()\nprint('hello', name)\nprint('to stderr', file=sys.stderr)", stdin="bob\n")
    assert result.ok and result.status == "ok" and result.exit_code == 0 and result.reason == "ok"
    assert result.stdout == "hello bob\n" and result.stderr == "to stderr\n"
    assert result.seconds > 0


@pytest.mark.parametrize(
    "code, exit_code, reason",
    [
        ("x = 1\n1 / 0", 1, "ZeroDivisionError: division by zero"),
        ("raise KeyError('k')", 1, "KeyError: 'k'"),
        ("def f(:\n  pass", 1, "SyntaxError"),
        ("import sys\nsys.exit(3)", 3, "exit code 3"),
    ],
)
def test_a_failing_program_is_an_error_with_the_reason(code, exit_code, reason):
    result = run_python(code)
    assert result.status == "error" and not result.ok and result.exit_code == exit_code
    assert result.reason.startswith(reason), result.reason
    _assert_still_works()


def test_an_exception_keeps_its_traceback_on_stderr():
    result = run_python("def f():\n    return 1 / 0\nf()")
    assert "Traceback" in result.stderr and "in f" in result.stderr and "ZeroDivisionError" in result.stderr


def test_an_infinite_loop_times_out_and_its_process_is_gone():
    limits = SandboxLimits(timeout_s=2, cpu_s=60)
    result = _timed(SHOW_FOLDER + "while True:\n    pass", limits)
    assert (result.status, result.exit_code, result.reason) == ("timeout", None, "timed out after 2 s")
    _assert_nothing_left(result)
    _assert_still_works()


def test_a_sleeping_program_times_out_too():
    result = _timed(SHOW_FOLDER + "import time\ntime.sleep(600)", SandboxLimits(timeout_s=1.5))
    assert result.status == "timeout" and result.reason == "timed out after 1.5 s"
    _assert_nothing_left(result)


def test_the_cpu_limit_stops_a_busy_program_before_the_wall_clock():
    result = _timed("while True:\n    pass", SandboxLimits(timeout_s=60, cpu_s=1))
    assert result.status == "timeout" and result.reason == "CPU time limit of 1 s exceeded", result


FORK_BOMBS = {
    "os.fork": ("while True:\n    os.fork()", "blocked: os.fork"),
    "multiprocessing": (
        "import multiprocessing, time\nwhile True:\n    multiprocessing.Process(target=time.sleep, args=(60,)).start()",
        "blocked: os.fork",
    ),
    "subprocess": (
        "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'while 1: pass'])",
        "blocked: subprocess.Popen",
    ),
    "fork_exec": (
        "import _posixsubprocess\n_posixsubprocess.fork_exec(['/bin/true'], [b'/bin/true'], True, (), None, None,"
        " -1, -1, -1, -1, -1, -1, -1, -1, False, False, -1, None, None, None, None)",
        "blocked: _posixsubprocess.fork_exec",
    ),
}


@pytest.mark.parametrize("name", sorted(FORK_BOMBS))
def test_a_fork_bomb_is_blocked_and_leaves_no_process(name, audit):
    code, reason = FORK_BOMBS[name]
    result = _timed(SHOW_FOLDER + code, audit=audit)
    if audit:
        assert result.status == "blocked" and result.reason.startswith(reason), result
    else:  # RLIMIT_NPROC, the timeout and the group kill (or the pid namespace) end it
        assert result.status in ("error", "timeout", "ok"), result
    _assert_nothing_left(result)
    _assert_still_works()


def test_a_fork_bomb_is_contained_by_the_kernel_without_the_audit_hook():
    """The hook off: RLIMIT_NPROC (an unprivileged uid) caps the bomb and the group kill (or the pid
    namespace) removes every process it made, including ones that started their own session."""
    iso = sandbox_isolation()
    if iso.uid is None and os.geteuid() == 0:
        pytest.skip("running as root without an unprivileged uid: RLIMIT_NPROC would not hold a real fork bomb")
    # children leave the group (setsid) only where a pid namespace still catches them
    escape = "os.setsid()" if iso.namespaces else "pass"
    loop = f"while True:\n  try:\n    if os.fork() == 0:\n      {escape}\n  except OSError:\n    time.sleep(0.01)"
    code = SHOW_FOLDER + "import time\n" + loop
    start = time.monotonic()
    result = sandbox._run(code, QUICK, "", iso, audit=False)
    assert time.monotonic() - start < QUICK.timeout_s + SLACK_S
    assert result.status == "timeout", result
    _assert_nothing_left(result)
    _assert_still_works()


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**11)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", "x = [0] * 10**10"],
    ids=["one_huge_allocation", "growing_list", "huge_list"],
)
def test_too_much_memory_is_status_memory(code):
    result = _timed(code)
    assert (result.status, result.reason) == ("memory", "MemoryError"), result
    _assert_still_works()


def test_writing_outside_the_folder_is_blocked(tmp_path, audit):
    target = tmp_path / "escaped.txt"
    result = _timed(f"open({str(target)!r}, 'w').write('pwned')", audit=audit)
    if audit:
        assert result.status == "blocked" and result.reason.startswith("blocked: open (writing"), result
    else:
        assert result.status == "error" and result.reason.startswith(("FileNotFoundError", "PermissionError")), result
    assert not target.exists()
    for code in (f"import os\nos.mkdir({str(tmp_path / 'd')!r})", f"import os\nos.remove({str(tmp_path)!r} + '/x')"):
        assert _timed(code, audit=audit).status == ("blocked" if audit else "error")
    assert list(tmp_path.iterdir()) == []
    _assert_still_works()


def test_reading_outside_the_folder_is_blocked(tmp_path, audit):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("SECRET-KEY")
    codes = [
        f"print(open({str(home / '.ssh' / 'id_rsa')!r}).read())",
        f"import pathlib\nprint(pathlib.Path({str(home)!r}, '.ssh', 'id_rsa').read_text())",
        f"import os\nos.symlink({str(home)!r}, 'h')\nprint(open('h/.ssh/id_rsa').read())",
        f"import os\nprint(os.listdir({str(home)!r}))",
    ]
    if audit:  # public system files (/etc) stay readable to the kernel layers: only the hook refuses them
        codes.append("print(open('/etc/passwd').read())")
    for code in codes:
        result = _timed(code, audit=audit)
        if audit:
            assert result.status == "blocked" and result.reason.startswith("blocked: "), (code, result)
        else:
            assert result.status == "error" and result.reason.startswith(("FileNotFoundError", "PermissionError")), result
        assert "SECRET" not in result.stdout and "root:" not in result.stdout
    _assert_still_works()


def test_a_caught_violation_still_ends_the_program():
    result = _timed("try:\n    open('/etc/passwd')\nexcept Exception:\n    pass\nprint('carried on')")
    assert result.status == "blocked" and "carried on" not in result.stdout


def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-hf")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-aws")
    monkeypatch.setenv("PYTHONPATH", "/nonexistent-injected")
    result = run_python("import os, sys\nprint(dict(os.environ))\nprint(sys.path)")
    assert result.ok, result
    assert "secret" not in result.stdout and "HF_TOKEN" not in result.stdout and "AWS_" not in result.stdout
    assert "nonexistent-injected" not in result.stdout  # python -I ignores PYTHON* variables


def test_a_socket_cannot_reach_a_local_listener(audit):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        connect = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')"
        connect = _timed(connect, audit=audit)
        bind = _timed("import socket\nsocket.socket().bind(('127.0.0.1', 0))", audit=audit)
        udp = f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))"
        udp = _timed(udp, audit=audit)
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    if audit:
        assert (connect.status, connect.reason) == ("blocked", "blocked: socket.connect"), connect
        assert (bind.status, bind.reason) == ("blocked", "blocked: socket.bind"), bind
        assert (udp.status, udp.reason) == ("blocked", "blocked: socket.sendto"), udp
    else:  # the network namespace has no interface up: nothing is reached (a bind there is harmless)
        assert [r.status for r in (connect, udp)] == ["error"] * 2 and bind.status in ("ok", "error"), (connect, bind, udp)
    _assert_still_works()


def test_signals_to_other_processes_and_ctypes_are_blocked():
    killer = _timed(f"import os\nos.kill({os.getpid()}, 0)")  # signal 0: harmless even if it got through
    assert killer.status == "blocked" and killer.reason.startswith("blocked: os.kill (signal to pid"), killer
    group = _timed("import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert (group.status, group.reason) == ("blocked", "blocked: os.killpg"), group
    loader = _timed("import ctypes\nctypes.CDLL(None)")
    assert loader.status == "blocked" and loader.reason.startswith("blocked: import ctypes"), loader
    optional = _timed("try:\n    import ctypes\nexcept ImportError:\n    ctypes = None\nprint(ctypes)")
    assert optional.ok and optional.stdout == "None\n", optional  # libraries that can do without it still load
    _assert_still_works()


def test_a_program_killed_by_a_signal_is_killed():
    result = _timed("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (result.status, result.exit_code, result.reason) == ("killed", None, "killed by SIGSEGV"), result


def test_huge_output_is_truncated():
    limits = SandboxLimits(max_output_bytes=1000)
    result = _timed("import sys\nprint('x' * 10**7)\nprint('y' * 10**6, file=sys.stderr)\nprint('end')", limits)
    assert result.ok, result
    assert result.stdout == "x" * 1000 and result.stderr == "y" * 1000
    assert result.reason == "ok (stdout and stderr truncated to 1000 bytes)"


def test_files_are_limited_in_size():
    result = _timed("open('big', 'wb').write(b'x' * 3 * 2**20)", SandboxLimits(max_file_mb=1))
    assert result.status == "error" and "File too large" in result.reason, result


def test_the_folder_is_private_writable_and_removed_afterwards():
    result = run_python(
        SHOW_FOLDER + "print(os.listdir('.'))\nopen('notes.txt', 'w').write('kept?')\nprint(open('notes.txt').read())"
    )
    assert result.ok, result
    assert result.stdout.splitlines()[1:] == ["[]", "kept?"]  # empty at the start, writable
    _assert_nothing_left(result)


def test_everyday_standard_library_use_is_not_blocked():
    code = """
import asyncio, dataclasses, json, os, pathlib, tempfile, threading, zoneinfo
from collections import namedtuple
from typing import NamedTuple
@dataclasses.dataclass
class A:
    x: int
class B(NamedTuple):
    y: int
async def main():
    return 3
with tempfile.TemporaryDirectory() as d:
    pathlib.Path(d, "f.json").write_text(json.dumps({"a": 1}))
    loaded = json.loads(pathlib.Path(d, "f.json").read_text())
t = threading.Thread(target=lambda: None)
t.start(); t.join()
print(A(1), B(2), namedtuple("C", "z")(3), asyncio.run(main()), loaded, zoneinfo.ZoneInfo("UTC"))
"""
    result = run_python(code, SandboxLimits(timeout_s=20))
    assert result.ok, result
    assert result.stdout == "A(x=1) B(y=2) C(z=3) 3 {'a': 1} UTC\n"


def test_run_many_keeps_order_and_a_hostile_program_spoils_nothing_else():
    codes = [f"print({i} * {i})" for i in range(6)]
    codes.insert(2, "while True:\n    pass")
    codes.insert(5, "import os\nos.fork()")
    start = time.monotonic()
    results = run_many(codes, SandboxLimits(timeout_s=2, cpu_s=60), workers=2)
    assert time.monotonic() - start < 2 * 2 + 6 * 1 + 2 * SLACK_S
    assert [r.status for r in results] == ["ok", "ok", "timeout", "ok", "ok", "blocked", "ok", "ok"]
    assert [r.stdout for r in results if r.ok] == [f"{i * i}\n" for i in range(6)]
    assert run_many([]) == []


def test_bad_limits_raise_and_nothing_else_does():
    with pytest.raises(ConfigError):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ConfigError):
        SandboxLimits(memory_mb=512, swap_mb=1)  # unknown keys are rejected
    with pytest.raises(TypeError):
        run_python("print(1)", limits={"timeout_s": 1})
    with pytest.raises(ValueError):
        run_many(["print(1)"], workers=0)
    assert run_python("\x00").status == "error"  # odd programs are results, not exceptions


def test_the_strongest_available_isolation_is_used():
    iso = sandbox_isolation()
    assert "audit hook" in iso.describe()
    unshare = shutil.which("unshare")
    flags = "-rn" if os.geteuid() else "-n"
    unshare_works = bool(unshare) and subprocess.run([unshare, flags, "true"], capture_output=True).returncode == 0
    if unshare_works:
        assert iso.namespaces, iso.describe()
    who = run_python("import os\nprint(os.getuid())")
    if iso.uid is not None:
        assert who.stdout == f"{iso.uid}\n" and iso.uid != 0


def test_the_kernel_layers_hold_without_the_audit_hook(tmp_path):
    """With the tripwire off, the namespaces and mounts alone keep the network and files out of reach."""
    iso = sandbox_isolation()
    if not (iso.namespaces and iso.mounts):
        pytest.skip(f"needs network and mount namespaces; here: {iso.describe()}")
    (tmp_path / "secret.txt").write_text("SECRET")
    home = Path(os.path.realpath(Path.home()))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"""
import os, socket
attempts = [lambda: open({str(tmp_path / "secret.txt")!r}).read(), lambda: open({str(tmp_path / "out.txt")!r}, "w").write("x"),
            lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)]
for attempt in attempts:
    try:
        print("LEAK", attempt())
    except OSError as err:
        print("refused", type(err).__name__)
print(sorted(os.listdir({str(home)!r})))
"""
        result = sandbox._run(code, QUICK, "", iso, audit=False)
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["refused"] * 3 and "SECRET" not in result.stdout, result.stdout
    assert not (tmp_path / "out.txt").exists()
    # the home is an empty tmpfs, apart from the way to the interpreter's own folders
    interpreter = [Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix)]
    allowed = {p.relative_to(home).parts[0] for p in interpreter if p != home and p.is_relative_to(home)}
    assert set(ast.literal_eval(lines[3])) <= allowed, (lines[3], allowed)
