"""The bootstrap of a sandboxed child process (see :mod:`verl_core.sandbox.runner`).

The parent never imports this module to run it: it reads this file's text and starts
``python -I -S -B -X utf8 -c <this text> verl-sandbox <config json>``, so the child needs nothing
from the project (the repository may be hidden from it). In order, :func:`main`

1. reads the program from an inherited, already-unlinked file (``code_fd``);
2. lowers the rlimits (address space, CPU seconds, processes, file size, no core dumps);
3. drops to the sandbox uid/gid with no supplementary groups (when the parent runs as root);
4. moves into the empty working folder and sets ``sys.path`` to the interpreter's own paths;
5. installs an audit hook (PEP 578) that ends the process at the first forbidden operation;
6. runs the program as ``__main__`` in a fresh module and reports how it ended.

Results go to the parent as one ``status<TAB>reason`` line on ``status_fd``. The program can write
to that descriptor too, so the parent uses such a line only to make a result worse, never better.

The audit hook is a tripwire that gives a clean ``blocked: <event>`` reason; it is not a
security boundary (CPython can be crashed or raced from pure Python). The boundaries are the
kernel's: namespaces, the unprivileged uid, rlimits and the process-group kill in the parent.
"""

from __future__ import annotations

import json
import os
import sys

BLOCKED_EXIT = 97  # the hook's exit code; the parent reads the status line for the reason
# An os.open/io.open flag that writes or creates: such an open must stay inside the folder.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# os.* events that modify paths: (index of a path argument, index of its dir_fd argument or None)
_WRITE_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
    "os.truncate": ((0, None),), "os.chflags": ((0, None),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
}  # fmt: skip
_READ_EVENTS = ("os.listdir", "os.scandir", "os.listxattr", "os.getxattr")
# Checked events; anything else under _DENIED_PREFIXES, and every event in _DENIED, ends the program.
_CHECKED = ("open", "import", "os.chdir", "os.symlink", "os.kill", "resource.setrlimit", "resource.prlimit")
_CHECKED += ("sqlite3.connect", *_WRITE_EVENTS, *_READ_EVENTS)
_DENIED = ("subprocess.Popen", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn")
_DENIED += ("os.killpg", "gc.get_objects", "gc.get_referrers", "gc.get_referents")
_DENIED_PREFIXES = ("socket.", "ctypes.", "syslog.", "sqlite3.", "_posixsubprocess.")
_ALLOWED = ("socket.__new__", "sqlite3.connect/handle")  # creating a socket (socketpair, asyncio) is harmless
# Modules whose import is refused (ImportError, so optional users such as numpy degrade):
# raw memory access and subinterpreters (whose audit hooks start empty) defeat the hook.
_DENIED_IMPORTS = ("ctypes", "_ctypes", "cffi", "_cffi_backend", "_xxsubinterpreters", "_xxinterpchannels", "_posixsubprocess")


def _report(status_fd: int, status: str, reason: str) -> None:
    line = f"{status}\t{reason}".replace("\n", " ")[:500] + "\n"
    try:
        os.write(status_fd, line.encode("utf-8", "replace"))
    except OSError:
        pass


def _apply_limits(cfg: dict) -> None:
    import resource

    mib = 1024 * 1024
    wanted = {
        resource.RLIMIT_AS: cfg["memory_mb"] * mib,
        resource.RLIMIT_CPU: cfg["cpu_s"],  # soft == hard: the kernel SIGKILLs at the limit
        resource.RLIMIT_NPROC: cfg["max_processes"],
        resource.RLIMIT_FSIZE: cfg["max_file_mb"] * mib,
        resource.RLIMIT_CORE: 0,
    }
    for res, value in wanted.items():
        hard = resource.getrlimit(res)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (value, value))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # as root this sets the real, effective and saved uid: there is no way back
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        raise RuntimeError(f"could not drop to uid {uid}")


def _install_hook(cfg: dict, status_fd: int) -> None:
    """Add the audit hook. Everything it uses is bound here (C functions, builtins, immutable
    copies of the tables), so that the program cannot weaken it by patching ``os``, ``builtins``
    or this module's globals; nothing the program can reach without ``gc`` (denied) refers to it."""
    import _posixsubprocess
    import _stat
    import pathlib
    import posix
    import resource

    lstat, stat, readlink, getcwd, getpid, write, exit_now = (
        posix.lstat, posix.stat, posix.readlink, posix.getcwd, posix.getpid, posix.write, posix._exit
    )  # fmt: skip
    is_link, is_dir, item = _stat.S_ISLNK, _stat.S_ISDIR, tuple.__getitem__
    getrlimit, infinity = resource.getrlimit, resource.RLIM_INFINITY
    isinstance_, type_, int_, tuple_, str_, bytes_, bytearray_ = isinstance, type, int, tuple, str, bytes, bytearray
    path_types, path_str = (pathlib.PosixPath, pathlib.PurePosixPath), pathlib.PurePath.__str__
    write_flags, blocked_exit, write_events, read_events = _WRITE_FLAGS, BLOCKED_EXIT, dict(_WRITE_EVENTS), _READ_EVENTS
    checked, denied, denied_prefixes, allowed = frozenset(_CHECKED), frozenset(_DENIED), _DENIED_PREFIXES, _ALLOWED
    denied_imports = _DENIED_IMPORTS
    work = cfg["workdir"]
    write_roots, read_roots = (work,), tuple_(cfg["read_roots"])
    write_files, read_files = ("/dev/null",), ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
    streams = (sys.stdout, sys.stderr)

    def deny(event: str, detail: str = "") -> None:
        reason = f"blocked: {event}" + (f" ({detail})" if detail else "")
        try:
            write(status_fd, f"blocked\t{reason}\n".encode("utf-8", "replace"))
            for stream in streams:
                stream.flush()
            write(2, f"\nsandbox: {reason}\n".encode("utf-8", "replace"))
        finally:
            exit_now(blocked_exit)

    def text(path: object) -> str:
        if type_(path) is str_:
            return path
        if isinstance_(path, str_):
            return "".join((path,))  # a str subclass's characters, without calling its methods
        if isinstance_(path, (bytes_, bytearray_)):
            return bytes_.decode(b"".join((path,)), "utf-8", "surrogateescape")
        if type_(path) in path_types:
            return path_str(path)
        raise TypeError("unsupported path object")

    def resolve(path: str, base: str | None = None) -> str:
        """The absolute path with symlinks followed, like os.path.realpath (missing parts lexically)."""
        if not path.startswith("/"):
            path = (base if base is not None else getcwd()) + "/" + path
        todo, out, links = path.split("/")[::-1], [], 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            candidate = "/" + "/".join(out + [part])
            try:
                mode = item(lstat(candidate), 0)
            except OSError:
                mode = 0
            if not is_link(mode):
                out.append(part)
                continue
            links += 1
            if links > 40:
                raise ValueError("too many symbolic links")
            target = readlink(candidate)
            if target.startswith("/"):
                out = []
            todo.extend(target.split("/")[::-1])
        return "/" + "/".join(out)

    def inside(path: str, roots: tuple) -> bool:
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return True
        return False

    def where(path: object, dir_fd: object = None) -> str:
        """The absolute path an os call with (path, dir_fd) acts on; a bare descriptor is its file."""
        if isinstance_(path, int_):
            return resolve(readlink(f"/proc/self/fd/{int_(path)}"))
        base = None if dir_fd is None or dir_fd == -1 else where(dir_fd)
        return resolve(text(path), base)

    def check(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance_(path, int_):
                return  # an already open descriptor (0-2, or one the program opened through this check)
            target = where(path)
            writing = bool(flags & write_flags) if type_(flags) is int_ else True  # unknown flags: as a write
            if writing and not (inside(target, write_roots) or target in write_files):
                deny("open", f"writing {target} outside the working folder")
            if not writing and not (inside(target, read_roots) or target in read_files):
                deny("open", f"reading {target} outside the working folder")
            try:
                directory = is_dir(item(stat(target), 0))
            except OSError:
                directory = False
            if directory and not inside(target, write_roots):
                deny("open", f"opening the directory {target}")  # a dir_fd outside would escape the checks
        elif event in write_events:
            for path_at, fd_at in write_events[event]:
                if isinstance_(args[path_at], int_) and event in ("os.truncate", "os.chmod", "os.chown", "os.utime"):
                    continue  # an already open descriptor
                target = where(args[path_at], None if fd_at is None else args[fd_at])
                if not inside(target, write_roots):
                    deny(event, f"{target} is outside the working folder")
        elif event in read_events:
            target = work if args[0] is None else where(args[0])
            if not (inside(target, read_roots) or inside(target, write_roots)):
                deny(event, f"{target} is outside the working folder")
        elif event == "os.chdir":
            if where(args[0]) != work:
                deny(event, "only the working folder itself")  # relative paths are checked against it
        elif event == "os.symlink":
            target = text(args[0])
            if ".." in target.split("/") or (target.startswith("/") and not inside(resolve(target), write_roots)):
                deny(event, f"a link to {target} could point outside the working folder")
            if not inside(where(args[1], args[2]), write_roots):
                deny(event, f"{text(args[1])} is outside the working folder")
        elif event == "import":
            if args[0] in denied_imports or args[0].startswith("_test"):
                raise ImportError(f"blocked: import {args[0]} (not allowed in the sandbox)")
        elif event == "os.kill":
            if args[0] != getpid():
                deny(event, f"signal to pid {args[0]}")
        elif event == "resource.setrlimit" or event == "resource.prlimit":
            pid, res, limits = (0, *args) if event == "resource.setrlimit" else args
            if pid != 0 and pid != getpid():
                deny(event, f"pid {pid}")
            hard = getrlimit(res)[1]
            if limits is not None and hard != infinity and not 0 <= item(tuple_(limits), 1) <= hard:
                deny(event, "raising a hard limit")
        elif event == "sqlite3.connect":
            name = "" if isinstance_(args[0], int_) else text(args[0])
            if name.startswith("file:") or (name not in ("", ":memory:") and not inside(resolve(name), write_roots)):
                deny(event, f"database {name} outside the working folder")

    def hook(event: str, args: tuple) -> None:
        if event in checked:
            try:
                check(event, args)
            except ImportError:
                raise
            except Exception as err:  # noqa: BLE001 - fail closed on anything the check cannot read
                deny(event, f"unreadable arguments: {type_(err).__name__}")
        elif (event in denied or event.startswith(denied_prefixes)) and event not in allowed:
            deny(event)  # processes, signals to others, sockets, ctypes, syslog, gc introspection

    def fork_exec(*args: object, **kwargs: object) -> None:
        deny("_posixsubprocess.fork_exec")

    # subprocess and multiprocessing call this module's fork_exec, which raises no audit event;
    # the module is loaded now so that a fresh copy (an "import" event) is refused above.
    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)


def _exception_reason(err: BaseException) -> str:
    try:
        message = str(err)
    except Exception:  # noqa: BLE001 - the program's own __str__ may fail
        message = ""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        message = f"{err.msg} (line {err.lineno})"
    name = type(err).__name__
    return f"{name}: {message}"[:300] if message else name


def main() -> None:
    cfg = json.loads(sys.argv[2])
    status_fd = cfg["status_fd"]
    chunks = []
    while chunk := os.read(cfg["code_fd"], 1 << 20):
        chunks.append(chunk)
    os.close(cfg["code_fd"])
    source = b"".join(chunks).decode("utf-8", "surrogatepass")
    _apply_limits(cfg)
    if cfg["uid"] is not None:
        _drop_privileges(cfg["uid"], cfg["gid"])
    os.chdir(cfg["workdir"])
    sys.path[:] = [p for p in sys.path if p] + [p for p in cfg["sys_path"] if p not in sys.path]
    cfg["read_roots"] = [cfg["workdir"], *(os.path.realpath(p) for p in sys.path), *cfg["read_roots"]]
    sys.argv = ["<sandbox>"]

    import traceback
    import types

    if cfg["audit"]:
        _install_hook(cfg, status_fd)
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module  # the program gets a fresh __main__, not this bootstrap
    try:
        exec(compile(source, "<sandbox>", "exec"), module.__dict__)
    except SystemExit:
        raise
    except MemoryError:
        module.__dict__.clear()  # free what the program held before reporting
        _report(status_fd, "memory", "MemoryError")
        sys.stderr.write("MemoryError\n")
        sys.stderr.flush()
        os._exit(1)
    except BaseException as err:  # noqa: BLE001 - every failure of the program is data
        traceback.print_exception(type(err), err, err.__traceback__.tb_next if err.__traceback__ else None)
        blocked = isinstance(err, ImportError) and str(err).startswith("blocked: ")
        _report(status_fd, "blocked" if blocked else "error", str(err) if blocked else _exception_reason(err))
        sys.exit(1)


if __name__ == "__main__":
    main()
