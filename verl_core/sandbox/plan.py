"""How the sandbox isolates a child: the candidate settings, the mount plan and the command line.

Kept apart from :mod:`verl_core.sandbox.runner` (which runs and watches the child) because this
part only decides *what* to start. With namespaces the command is
``unshare --net --pid --fork --kill-child [--mount --mount-proc] -- sh -c SCRIPT verl-sandbox
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
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = SANDBOX_GID = 65534  # "nobody": owns nothing, is in no group
DATA_DIRS = ("/usr/share/zoneinfo",)  # public data the stdlib reads (zoneinfo); readable by the program
_CHILD_SOURCE = Path(__file__).with_name("child.py")
_RUN = '"$@"; exit $?'  # not `exec`: sh stays the namespace's init and reports a signal as 128 + n


@dataclass(frozen=True)
class Isolation:
    """Which kernel layers a sandboxed child gets (the rlimits, timeout and hook it always gets)."""

    namespaces: bool  # new network and pid namespaces (unshare)
    user_namespace: bool  # inside a user namespace (non-root callers: --map-root-user)
    mounts: bool  # new mount namespace: private tmpfs folder, home/repository/temp folders hidden
    uid: int | None  # the uid the child drops to (root callers), None: the caller's

    def describe(self) -> str:
        parts = []
        if self.namespaces:
            parts.append("network and pid namespaces" + (" (in a user namespace)" if self.user_namespace else ""))
        else:
            parts.append("no namespaces (network blocked by the audit hook only)")
        if self.mounts:
            parts.append("mount namespace (private tmpfs folder; home, repository and temp folders hidden)")
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


@functools.lru_cache(maxsize=1)
def _plan() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(folders to hide, temp folders to replace, interpreter folders to mount back), fixed per process."""
    real = lambda p: os.path.realpath(p)  # noqa: E731
    keeps = _outermost(
        [real(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site_dirs()) if os.path.isdir(p)]
        + [os.path.dirname(real(sys.executable))]
    )
    temp = real(tempfile.gettempdir())

    def usable(path: str) -> bool:  # never "/" and never a folder inside (or equal to) an interpreter folder
        return os.path.isdir(path) and path != "/" and not any(_within(path, k) for k in keeps)

    temps = [t for t in map(real, ("/tmp", "/var/tmp", "/dev/shm", temp)) if usable(t)]
    temps = _outermost([t for t in temps if not any(_within(k, t) for k in keeps)])
    candidates = [os.path.expanduser("~"), "/root", "/home", str(Path(__file__).resolve().parents[2]), os.getcwd()]
    hidden = [h for h in map(real, candidates) if usable(h) and not _within(temp, h) and not any(_within(h, t) for t in temps)]
    hidden = _outermost(hidden)
    binds = tuple(k for k in keeps if any(_within(k, h) for h in hidden))
    return tuple(hidden), tuple(temps), binds


def _mount_script(root: str, workdir: str, folder_mb: int, uid: int | None, user_namespace: bool) -> str:
    """The shell lines run as root of the new mount namespace before Python starts."""
    hidden, temps, binds = _plan()
    q, mount, mkdir = shlex.quote, _tool("mount"), _tool("mkdir")
    lines = ["set -e", "umask 022"]
    # 1. keep the interpreter's folders reachable (staged under the run's folder), 2. hide their
    # ancestors (the home, the repository) behind empty tmpfs, 3. put the interpreter back, read-only
    lines += [f"{mount} --bind {q(k)} {q(os.path.join(root, f's{i}'))}" for i, k in enumerate(binds)]
    lines += [f"{mount} -t tmpfs -o mode=0755,size=1m,nosuid,nodev sandbox-hidden {q(h)}" for h in hidden]
    for i, k in enumerate(binds):
        lines += [f"{mkdir} -p {q(k)}", f"{mount} --move {q(os.path.join(root, f's{i}'))} {q(k)}"]
        lines.append(f"{mount} -o remount,bind,ro,nosuid,nodev {q(k)}")
    # 4. fresh, nearly full temp folders; 5. the working folder: a private, size-limited tmpfs
    lines += [f"{mount} -t tmpfs -o mode=1777,size=1m,nosuid,nodev sandbox-temp {q(t)}" for t in temps]
    owner = f",uid={uid},gid={SANDBOX_GID}" if uid is not None else ""
    options = f"mode=0700,size={folder_mb}m,nr_inodes=4096,nosuid,nodev{owner}"
    lines += [f"{mkdir} -p {q(workdir)}", f"{mount} -t tmpfs -o {options} sandbox-work {q(workdir)}"]
    if not user_namespace:  # in a user namespace set-uid bits of unmapped owners are ignored anyway
        lines.append(f"{mount} -o remount,bind,nosuid /")
    return "\n".join([*lines, _RUN])


def prepare_folders(iso: Isolation, root: str, workdir: str) -> None:
    """Make the run's folders usable by the child: stage points for the mounts, or an owned folder."""
    if iso.mounts:
        for i in range(len(_plan()[2])):
            os.mkdir(os.path.join(root, f"s{i}"), 0o700)
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
    flags = ["--net", "--pid", "--fork", "--kill-child"]
    if iso.user_namespace:
        flags.insert(0, "--map-root-user")
    if iso.mounts:
        flags += ["--mount", "--mount-proc"]
        script = _mount_script(root, cfg["workdir"], folder_mb, iso.uid, iso.user_namespace)
    else:
        script = _RUN
    return [_tool("unshare"), *flags, "--", _tool("sh"), "-c", script, "verl-sandbox", *python]
