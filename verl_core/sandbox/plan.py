"""How the sandbox isolates a child: the candidate settings, the mount plan and the command line.

Kept apart from :mod:`verl_core.sandbox.runner` (which runs and watches the child) because this
part only decides *what* to start. With namespaces the command is
``unshare --net --pid --ipc --fork --kill-child [--mount --mount-proc] -- sh -c SCRIPT verl-sandbox
python -I -S -B -X utf8 -c <bootstrap> verl-sandbox <config>``: ``sh`` is the pid namespace's
init, so Python is an ordinary process (signals and exit codes as usual) and when ``sh`` ends
the kernel kills whatever the program left in the namespace. ``SCRIPT`` does the mounts (as root
of the new mount namespace, before Python starts and drops privileges) and runs Python.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import stat
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = SANDBOX_GID = 65534  # "nobody": owns nothing, is in no group
DATA_DIRS = ("/usr/share/zoneinfo",)  # public data the stdlib reads (zoneinfo); readable by the program
# Writable shared places hidden behind a private tmpfs; SCANNED_DIRS (and every mount point) are
# searched one level deep for more folders the sandbox uid could write to.
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/var/crash")
SCANNED_DIRS = ("/", "/var", "/run", "/dev", "/var/lib", "/var/spool", "/var/cache", "/var/mail", "/srv", "/opt", "/mnt")
_CHILD_SOURCE = Path(__file__).with_name("child.py")
_RUN = '"$@"; exit $?'  # not `exec`: sh stays the namespace's init and reports a signal as 128 + n


@dataclass(frozen=True)
class Isolation:
    """Which kernel layers a sandboxed child gets (the rlimits, timeout and hook it always gets)."""

    namespaces: bool  # new network, pid and IPC namespaces (unshare)
    user_namespace: bool  # inside a user namespace (non-root callers: --map-root-user)
    mounts: bool  # new mount namespace: private tmpfs folder; home, repository and shared writable folders hidden
    uid: int | None  # the uid the child drops to (root callers), None: the caller's

    def describe(self) -> str:
        parts = []
        if self.namespaces:
            parts.append("network, pid and IPC namespaces" + (" (in a user namespace)" if self.user_namespace else ""))
        else:
            parts.append("no namespaces (network blocked by the audit hook only)")
        if self.mounts:
            ro = "" if self.user_namespace else "; / read-only"
            hidden = "home, repository, /tmp and other shared writable folders hidden"
            parts.append(f"mount namespace (private tmpfs folder; {hidden}{ro})")
        else:
            parts.append("no mount namespace (/tmp, /dev/shm, home and repository NOT hidden: only the audit hook guards them)")
        parts.append(f"uid {self.uid}" if self.uid is not None else f"the caller's uid {os.geteuid()}")
        return "; ".join(parts) + "; rlimits, group kill, empty environment, audit hook"


def _tool(name: str) -> str | None:
    for folder in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        if os.access(os.path.join(folder, name), os.X_OK):
            return os.path.join(folder, name)
    return shutil.which(name)


def isolation_candidates() -> list[Isolation]:
    """Settings to try, strongest first; :func:`~verl_core.sandbox.runner.sandbox_isolation` keeps
    the first whose probe works (so a container that forbids namespaces or mounts falls back)."""
    root = os.geteuid() == 0
    out = []
    if _tool("unshare") and _tool("sh"):
        if root:
            out += [Isolation(True, False, True, SANDBOX_UID), Isolation(True, False, False, SANDBOX_UID)]
            out += [Isolation(True, False, True, None), Isolation(True, False, False, None)]
        else:
            out += [Isolation(True, True, True, None), Isolation(True, True, False, None)]
    if root:
        out.append(Isolation(False, False, False, SANDBOX_UID))
    out.append(Isolation(False, False, False, None))
    return [c for c in out if not c.mounts or (_tool("mount") and _tool("mkdir"))]


def site_dirs() -> list[str]:
    """The interpreter's site-packages folders (the child gets them on ``sys.path`` and may read them)."""
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[k]) for k in ("purelib", "platlib") if os.path.isdir(paths[k])})


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _outermost(paths: list[str]) -> list[str]:
    unique = sorted(set(paths))
    return [p for p in unique if not any(q != p and _within(p, q) for q in unique)]


def _writable_by_sandbox(path: str) -> bool:
    """A folder that any user, or the sandbox uid or group, may write to (following links)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    owned = st.st_uid == SANDBOX_UID or (st.st_gid == SANDBOX_GID and st.st_mode & stat.S_IWGRP)
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH or owned)


def _mount_points() -> list[str]:
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].replace("\\040", " ") for line in f if len(line.split()) > 4]
    except OSError:
        return []
    return [p for p in points if not _within(p, "/proc") and not _within(p, "/sys") and not _within(p, "/dev/pts")]


def shared_writable_dirs() -> list[str]:
    """The writable shared places: the usual temp folders and every folder writable by the sandbox
    uid found at the top of the file systems (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ...)."""
    found = [p for p in SHARED_DIRS if _writable_by_sandbox(p)]
    for top in {*SCANNED_DIRS, *_mount_points()}:
        found += [top] if _writable_by_sandbox(top) and top != "/" else []
        try:
            with os.scandir(top) as entries:
                found += [e.path for e in entries if e.is_dir(follow_symlinks=False) and _writable_by_sandbox(e.path)]
        except OSError:
            continue
    return sorted({os.path.realpath(p) for p in found})


@functools.lru_cache(maxsize=1)
def _plan() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """((folder, tmpfs mode) to cover with an empty tmpfs, interpreter folders to mount back), fixed per process.

    Covered: the home, the repository and the caller's working folder (mode 0755: nothing to see)
    and every writable shared place (mode 1777: a private, empty, 1 MiB temp folder)."""
    real = lambda p: os.path.realpath(p)  # noqa: E731
    keeps = _outermost(
        [real(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site_dirs()) if os.path.isdir(p)]
        + [os.path.dirname(real(sys.executable))]
    )

    def usable(path: str) -> bool:  # never "/" and never a folder inside (or equal to) an interpreter folder
        return os.path.isdir(path) and path != "/" and not any(_within(path, k) for k in keeps)

    temps = [t for t in map(real, (*shared_writable_dirs(), tempfile.gettempdir())) if usable(t)]
    hidden = [os.path.expanduser("~"), "/root", "/home", str(Path(__file__).resolve().parents[2]), os.getcwd()]
    hidden = [h for h in map(real, hidden) if usable(h)]
    covers = _outermost([*hidden, *temps])
    modes = tuple((c, "1777" if c in temps and c not in hidden else "0755") for c in covers)
    return modes, tuple(k for k in keeps if any(_within(k, c) for c in covers))


def _mount_script(root: str, workdir: str, folder_mb: int, uid: int | None, user_namespace: bool) -> str:
    """The shell lines run as root of the new mount namespace before Python starts.

    Each covered folder gets a fresh tmpfs, first at a staging point in the run's folder, where
    the interpreter's folders (read-only) and the working folder are put back inside it; then it
    is moved over the folder, the one holding the run's folder last (it hides the staging points)."""
    covers, keeps = _plan()
    q, mount, mkdir = shlex.quote, _tool("mount"), _tool("mkdir")
    lines, moves = ["set -e", "umask 022"], []
    owner = f",uid={uid},gid={SANDBOX_GID}" if uid is not None else ""
    work_mount = f"{mount} -t tmpfs -o mode=0700,size={folder_mb}m,nr_inodes=4096,nosuid,nodev{owner} sandbox-work"
    for i, (cover, mode) in enumerate(covers):
        stage = os.path.join(root, f"c{i}")
        name = "sandbox-temp" if mode == "1777" else "sandbox-hidden"
        lines.append(f"{mount} -t tmpfs -o mode={mode},size=1m,nosuid,nodev {name} {q(stage)}")
        for k in (k for k in keeps if _within(k, cover)):
            inner = q(os.path.join(stage, os.path.relpath(k, cover)))
            lines += [f"{mkdir} -p {inner}", f"{mount} --bind {q(k)} {inner}", f"{mount} -o remount,bind,ro,nosuid,nodev {inner}"]
        if _within(workdir, cover):
            inner = q(os.path.join(stage, os.path.relpath(workdir, cover)))
            lines += [f"{mkdir} -p {inner}", f"{work_mount} {inner}"]
        moves.insert(len(moves) if _within(root, cover) else 0, f"{mount} --move {q(stage)} {q(cover)}")
    if not any(_within(workdir, cover) for cover, _ in covers):
        lines += [f"{mkdir} -p {q(workdir)}", f"{work_mount} {q(workdir)}"]
    lines += moves
    if not user_namespace:  # in a user namespace set-uid bits of unmapped owners are ignored anyway
        lines.append(f"{mount} -o remount,bind,ro,nosuid /")  # any other writable folder of / too
    return "\n".join([*lines, _RUN])


def prepare_folders(iso: Isolation, root: str, workdir: str) -> None:
    """Make the run's folders usable by the child: stage points for the mounts, or an owned folder."""
    if iso.mounts:
        for i in range(len(_plan()[0])):
            os.mkdir(os.path.join(root, f"c{i}"), 0o700)
    if iso.uid is not None:
        os.chmod(root, 0o711)  # traversable, not listable: the child reaches only its own folder
        if not iso.mounts:
            os.chown(workdir, iso.uid, SANDBOX_GID)


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    return _CHILD_SOURCE.read_text()


def command(iso: Isolation, cfg: dict, root: str, folder_mb: int) -> list[str]:
    """The argv that starts the child with ``cfg`` (descriptors, folder, limits) under ``iso``."""
    gid = SANDBOX_GID if iso.uid is not None else None
    cfg = dict(cfg, uid=iso.uid, gid=gid, sys_path=site_dirs(), read_roots=[*site_dirs(), *DATA_DIRS])
    python = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _child_source(), "verl-sandbox", json.dumps(cfg)]
    if not iso.namespaces:
        return python
    flags = ["--net", "--pid", "--ipc", "--fork", "--kill-child"]
    if iso.user_namespace:
        flags.insert(0, "--map-root-user")
    if iso.mounts:
        flags += ["--mount", "--mount-proc"]
        script = _mount_script(root, cfg["workdir"], folder_mb, iso.uid, iso.user_namespace)
    else:
        script = _RUN
    return [_tool("unshare"), *flags, "--", _tool("sh"), "-c", script, "verl-sandbox", *python]
