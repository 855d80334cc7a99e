"""Run untrusted, model-written Python in a contained child process; its result is data.

:func:`run_python` starts the program in a fresh child process and returns a
:class:`SandboxResult`. Whatever the program does (loop forever, fork, allocate 100 GB, print
gigabytes, open sockets, read ``~/.ssh``), the call returns within the wall-clock limit plus a
little, with ``status`` saying how the program ended and ``reason`` saying why in one line, so a
training run can score it 0 and go on. :func:`run_many` runs a batch on a few worker threads.

Layers, from the strongest (the kernel's) to the weakest (the interpreter's):

- **namespaces** (``unshare``, when it works): a new network namespace (no interface but a down
  loopback: nothing can be reached), a pid namespace (when the sandbox ends, the kernel kills
  every process left in it, even ones that left the process group), an IPC namespace (no
  System V or POSIX IPC objects shared with the machine) and, where mounts are allowed, a mount
  namespace in which the working folder is a private, size-limited tmpfs; the user's home, the
  repository and the parent's working folder are hidden behind empty tmpfs mounts (root's, 0755), and
  every writable shared place (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, the temp
  folder and any folder the sandbox uid may write to found at the top of each file system; see
  :func:`verl_core.sandbox.plan.shared_writable_dirs`) behind a private, empty 1 MiB tmpfs; the
  interpreter's own folders are mounted back read-only, also when they lie inside one of those,
  and ``/`` is remounted read-only (not in a user namespace), so deeper writable folders of the
  root file system are closed too. Another run's files in ``/tmp`` (an ``mlflow.db``) are out of
  sight even for a program that gets past the audit hook.
- **an unprivileged uid** (65534, no groups) when the parent runs as root: file permissions
  apply and ``RLIMIT_NPROC`` is enforced (the kernel does not enforce it for root). The limit
  counts every process of that uid, so concurrent sandboxes share it.
- **rlimits** set by the child before the program runs: address space, CPU seconds, processes,
  file size, no core dumps.
- **a wall-clock timeout**: the child runs in its own session and the whole process group is
  killed with SIGKILL at the deadline (and after a normal exit, for leftovers).
- **an empty environment** (no ``HF_TOKEN`` or ``AWS_SECRET_ACCESS_KEY``), ``python -I -S``
  (``PYTHON*`` variables, the user site and ``.pth`` files ignored) and a fresh folder that is
  deleted afterwards, also on timeout.
- **an audit hook** (:mod:`verl_core.sandbox.child`) that ends the program at the first
  process creation, socket connect or bind, ``ctypes`` use, signal to another process, or file
  access outside the folder (reads are also allowed in the interpreter's own folders), with
  ``reason = "blocked: <event> (...)"``. It is a tripwire, not a boundary: CPython can be
  crashed or raced from pure Python (a symlink swapped between the check and the open, crafted
  bytecode), and then only the layers above hold.

Weaker settings are chosen automatically and logged once (:func:`sandbox_isolation`): as a
non-root user, ``unshare --map-root-user`` gives the same namespaces but no uid change (the
program runs with the caller's file permissions, in a user namespace, and ``RLIMIT_NPROC``
counts all the caller's processes); without ``unshare`` (or where namespaces are not permitted,
as in many containers) there is no network or pid isolation and nothing is hidden: the audit
hook is then the only thing between the program and the network and the caller's files, and a
program that defeats it can reach both; the rlimits, the timeout and the group kill still hold.
Where namespaces work but mounts do not, nothing is hidden either (``/tmp``, ``/dev/shm``, the
home): :meth:`Isolation.describe` says so in the logged line.

The audit hook can be switched off only through the private ``_run(..., audit=False)``, which
the tests use to run the hostile programs against the kernel layers alone.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import Field

from verl_core.config import StrictConfig
from verl_core.sandbox.plan import Isolation, command, isolation_candidates, prepare_folders

logger = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "blocked", "killed")
_STATUS_CAP = 4096  # bytes kept of the child's status lines
_DRAIN_S = 2.0  # how long output is still read after the child is gone (descendants holding a pipe)
_PROBE = """import decimal, fractions, json, os
open("probe", "w").write("x")
print("sandbox-probe", os.getuid(), open("probe").read())
"""


class SandboxLimits(StrictConfig):
    """Resource limits of one sandboxed run (the defaults suit a short reward program)."""

    timeout_s: float = Field(5.0, gt=0, le=3600)  # wall clock, interpreter start included
    cpu_s: int = Field(5, ge=1, le=3600)  # RLIMIT_CPU: SIGKILL at this many CPU seconds
    memory_mb: int = Field(512, ge=32, le=1 << 20)  # RLIMIT_AS: allocations beyond fail (MemoryError)
    max_processes: int = Field(8, ge=1, le=4096)  # RLIMIT_NPROC (counts threads; only when not root)
    max_output_bytes: int = Field(65536, ge=0, le=1 << 30)  # stdout and stderr are each cut here
    max_file_mb: int = Field(16, ge=0, le=1 << 20)  # RLIMIT_FSIZE; the private folder holds 4x this


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended. ``status`` is one of :data:`STATUSES`."""

    status: str  # "ok" | "error" | "timeout" | "memory" | "blocked" | "killed"
    exit_code: int | None  # the program's exit code; None when it was killed
    stdout: str
    stderr: str
    reason: str  # one line: "ok", "ZeroDivisionError: division by zero", "timed out after 5 s", ...
    seconds: float  # wall clock of the run

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --- isolation: probed once per process -----------------------------------------------------

_isolation: Isolation | None = None
_isolation_lock = threading.Lock()


def sandbox_isolation() -> Isolation:
    """The strongest isolation that works here, found by running a probe program once.

    Candidates go from namespaces + mounts + uid 65534 down to a plain child process; the first
    whose probe runs correctly is kept for the life of the process and logged once.
    """
    global _isolation
    with _isolation_lock:
        if _isolation is None:
            for candidate in isolation_candidates():
                result = _run(_PROBE, SandboxLimits(timeout_s=30), "", candidate, audit=True)
                expected = candidate.uid if candidate.uid is not None else (0 if candidate.user_namespace else os.geteuid())
                if result.ok and result.stdout.split() == ["sandbox-probe", str(expected), "x"]:
                    _isolation = candidate
                    break
                logger.debug("sandbox: %s failed its probe: %s %s", candidate.describe(), result.reason, result.stderr[-300:])
            else:
                _isolation = Isolation(namespaces=False, user_namespace=False, mounts=False, uid=None)
                logger.error("sandbox: no isolation candidate passed its probe; running plain child processes")
            log = logger.info if _isolation.namespaces and (_isolation.uid is not None or os.geteuid() != 0) else logger.warning
            log("sandbox isolation: %s", _isolation.describe())
        return _isolation


# --- one run -----------------------------------------------------------------------------------


def _child_env(workdir: str) -> dict[str, str]:
    """What the child sees of an environment: nothing of the parent's, only what Python needs."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of the group. One signal suffices: the kernel aborts a fork that races
    with a group kill, so no child created meanwhile survives it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    """Delete the run's folder even if the program made parts of it unreadable."""

    def fix(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def _text(data: bytearray) -> str:
    return bytes(data).decode("utf-8", "replace")


def _last_record(status: bytearray) -> tuple[str, str] | None:
    for line in reversed(bytes(status).decode("utf-8", "replace").splitlines()):
        kind, _, reason = line.partition("\t")
        if kind in ("blocked", "memory", "error") and reason:
            return kind, reason.strip()[:300]
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _classify(
    limits: SandboxLimits, iso: Isolation, rc: int | None, timed_out: bool, record: tuple | None, stderr: str, cpu: float
) -> tuple[str, int | None, str]:
    """(status, exit_code, reason) of a finished run; a status line only ever makes it worse."""
    if timed_out:
        return "timeout", None, f"timed out after {limits.timeout_s:g} s"
    sig = None
    if rc is not None and rc < 0:
        sig = -rc
    elif rc is not None and iso.namespaces and rc > 128 and record is None:
        sig = rc - 128  # sh, the namespace's init, reports a signal as 128 + its number
    if record is not None:
        return record[0], None if sig else rc, record[1]
    if sig is None and rc == 0:
        return "ok", 0, "ok"
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if sig in (signal.SIGKILL, signal.SIGXCPU) and cpu >= 0.9 * limits.cpu_s:
        return "timeout", None, f"CPU time limit of {limits.cpu_s} s exceeded"
    if "MemoryError" in tail or "Cannot allocate memory" in stderr or "bad_alloc" in stderr:
        return "memory", None if sig else rc, "MemoryError" if "MemoryError" in tail else "out of memory"
    if sig is not None:
        return "killed", None, f"killed by {_signal_name(sig)}"
    return "error", rc, f"exit code {rc}"


def _collect(proc: subprocess.Popen, status_r: int, limits: SandboxLimits, start: float) -> tuple:
    """Read stdout, stderr and the status pipe until the child is gone; kill it at the deadline.

    Output beyond the cap is read and dropped, so the child never blocks on a full pipe.
    Returns (rc, timed_out, stdout, stderr, status, cpu seconds, dropped stdout/stderr bytes).
    """
    caps = {"stdout": limits.max_output_bytes, "stderr": limits.max_output_bytes, "status": _STATUS_CAP}
    bufs = {name: bytearray() for name in caps}
    dropped = {name: 0 for name in caps}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except OSError:
            pidfd = None
    rc, timed_out, cpu, finished_at = None, False, 0.0, None
    deadline = start + limits.timeout_s
    try:
        while True:
            now = time.monotonic()
            if rc is None:
                # WNOWAIT: the child stays unreaped while its group is killed, so its pid (the
                # group's id) cannot have been reused by another process when killpg runs
                exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                timed_out = not exited and now >= deadline
                if exited or timed_out:
                    _kill_group(proc.pid)  # at the deadline: everything; after an exit: what outlived it
                    _, status, usage = os.wait4(proc.pid, 0)
                    rc, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
                    proc.returncode = rc
                    finished_at = time.monotonic()
            streams = [k for k in sel.get_map().values() if k.data != "exit"]
            if rc is not None and (not streams or time.monotonic() > finished_at + _DRAIN_S):
                break
            wait = (deadline if rc is None else finished_at + _DRAIN_S) - time.monotonic()
            for key, _ in sel.select(timeout=max(0.0, min(wait, 0.2 if pidfd is None else wait))):
                if key.data == "exit":
                    sel.unregister(key.fileobj)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                room = max(0, caps[key.data] - len(bufs[key.data]))
                bufs[key.data] += chunk[:room]
                dropped[key.data] += len(chunk) - min(room, len(chunk))
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return rc, timed_out, bufs["stdout"], bufs["stderr"], bufs["status"], cpu, dropped


def _run(code: str, limits: SandboxLimits, stdin: str, iso: Isolation, audit: bool = True) -> SandboxResult:
    """One sandboxed run under the given isolation.

    ``audit=False`` leaves the audit hook out (for tests only: tests/test_sandbox.py and
    tests/test_sandbox_layers.py run every hostile program with it on and off, to show that the
    kernel layers hold on their own); :func:`run_python` always installs it."""
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="verl-sandbox-")
    workdir = os.path.join(root, "work")
    status_r = status_w = None
    try:
        os.mkdir(workdir, 0o700)
        prepare_folders(iso, root, workdir)
        with tempfile.TemporaryFile() as code_file, tempfile.TemporaryFile() as stdin_file:
            code_file.write(code.encode("utf-8", "surrogatepass"))
            code_file.seek(0)
            stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
            stdin_file.seek(0)
            status_r, status_w = os.pipe()
            cfg = {"code_fd": code_file.fileno(), "status_fd": status_w, "workdir": workdir, "audit": audit}
            cfg.update(limits.model_dump(include={"cpu_s", "memory_mb", "max_processes", "max_file_mb"}))
            cmd = command(iso, cfg, root, folder_mb=max(8, 4 * limits.max_file_mb))
            proc = subprocess.Popen(
                cmd,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(code_file.fileno(), status_w),
                cwd="/",
                env=_child_env(workdir),
                start_new_session=True,  # its own process group, killed as a whole
            )
            os.close(status_w)
            status_w = None
            try:
                rc, timed_out, out, err, status, cpu, dropped = _collect(proc, status_r, limits, start)
            finally:
                if proc.returncode is None:  # the parent failed or was interrupted: the child goes too
                    _kill_group(proc.pid)
                    proc.wait()
                proc.stdout.close()
                proc.stderr.close()
    except OSError as err:  # the machine, not the program: no process, no memory, no disk
        reason = f"sandbox could not start: {type(err).__name__}: {err}"[:300]
        return SandboxResult("error", None, "", "", reason, time.monotonic() - start)
    finally:
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
        _remove_tree(root)
    stderr = _text(err)
    result_status, exit_code, reason = _classify(limits, iso, rc, timed_out, _last_record(status), stderr, cpu)
    cut = [name for name in ("stdout", "stderr") if dropped[name]]
    if cut:
        reason += f" ({' and '.join(cut)} truncated to {limits.max_output_bytes} bytes)"
    return SandboxResult(result_status, exit_code, _text(out), stderr, reason, time.monotonic() - start)


def _checked_limits(limits: SandboxLimits | None) -> SandboxLimits:
    if limits is None:
        return SandboxLimits()
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits or None, got {type(limits).__name__}")
    return SandboxLimits.model_validate(limits.model_dump())  # re-checked: a copy nobody else mutates


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandboxed child process and return how it ended.

    Never raises for anything the program does: a crash, a timeout, a memory blow-up or a
    forbidden operation is a result (``status`` and ``reason``). Raises only for a bad
    ``limits`` (TypeError, or ConfigError when building the limits) or non-string arguments.
    """
    limits = _checked_limits(limits)
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("code and stdin must be str")
    return _run(code, limits, stdin, sandbox_isolation())


def run_many(codes: Sequence[str], limits: SandboxLimits | None = None, workers: int = 2) -> list[SandboxResult]:
    """:func:`run_python` for each program, ``workers`` at a time; results in the order of ``codes``.

    Each program runs in its own child, so a hostile one among them costs only its own slot.
    """
    limits = _checked_limits(limits)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    codes = list(codes)
    if not all(isinstance(code, str) for code in codes):
        raise TypeError("every program must be a str")
    if not codes:
        return []
    sandbox_isolation()  # probe once, before the threads start
    with ThreadPoolExecutor(max_workers=min(workers, len(codes)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda code: run_python(code, limits), codes))


__all__ = ["STATUSES", "Isolation", "SandboxLimits", "SandboxResult", "run_many", "run_python", "sandbox_isolation"]
