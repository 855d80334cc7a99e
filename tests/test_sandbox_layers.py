"""The sandbox's kernel layer hides every writable shared place, with the audit hook on and off.

The hook is a tripwire; these tests check that the layers under it hold on their own: a program
run with ``audit=False`` (:func:`verl_core.sandbox.runner._run`) writes into ``/tmp``,
``/var/tmp``, ``/dev/shm``, ``/run/lock`` and every other folder the sandbox uid could write to,
reads a file the parent planted in ``/tmp`` (another run's ``mlflow.db``) and lists ``/tmp``;
nothing of it may reach the parent's folders. Where the machine gives no mount namespace the
hook-off cases are skipped with the reason (nothing can be hidden there).
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import pytest

from verl_core.sandbox import plan
from verl_core.sandbox import runner as sandbox
from verl_core.sandbox.runner import SandboxLimits, SandboxResult, run_python, sandbox_isolation

pytestmark = pytest.mark.fast

QUICK = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=256)
# Folders any user may write to on common systems; the scan below adds what this machine has.
COMMON_SHARED = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/var/crash")


def _kernel_isolation():
    iso = sandbox_isolation()
    if not (iso.namespaces and iso.mounts):
        pytest.skip(f"the kernel layer cannot hide folders here (no mount namespace): {iso.describe()}")
    return iso


@pytest.fixture(params=[True, False], ids=["hook_on", "hook_off"])
def audit(request) -> bool:
    if not request.param:
        _kernel_isolation()
    return request.param


def _run(code: str, audit: bool) -> SandboxResult:
    return run_python(code, QUICK) if audit else sandbox._run(code, QUICK, "", sandbox_isolation(), audit=False)


def _writable_by_anyone(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    sandbox_owned = st.st_uid == plan.SANDBOX_UID or (st.st_gid == plan.SANDBOX_GID and st.st_mode & stat.S_IWGRP)
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH or sandbox_owned)


def _shared_writable_places() -> list[str]:
    """World-writable folders of this machine (an oracle independent of the plan's own scan)."""
    found = {os.path.realpath(p) for p in COMMON_SHARED if _writable_by_anyone(p)}
    found.add(os.path.realpath(tempfile.gettempdir()))
    for top in ("/", "/var", "/run", "/dev", "/var/lib", "/var/spool", "/var/cache", "/srv", "/opt", "/mnt"):
        try:
            entries = [e.path for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        found.update(os.path.realpath(p) for p in entries if _writable_by_anyone(p) and not p.startswith(("/proc", "/sys")))
    return sorted(found)


def _planted_file() -> Path:
    """Another run's database, as a user with umask 022 leaves it in /tmp: readable by everyone."""
    folder = Path("/tmp") / f"verl-test-planted-{uuid.uuid4().hex}"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    db = folder / "mlflow.db"
    db.write_text("SECRET-RUN-DATA")
    os.chmod(db, 0o644)
    return db


def test_writes_into_shared_writable_places_do_not_reach_them(audit):
    token = uuid.uuid4().hex
    places = _shared_writable_places()
    assert "/tmp" in places
    targets = [os.path.join(p, f"verl-sandbox-escape-{token}") for p in places]
    code = f"""
for target in {targets!r}:
    try:
        with open(target, "w") as f:
            f.write("escaped")
        print("wrote", target, flush=True)
    except OSError as err:
        print("refused", target, type(err).__name__, flush=True)
"""
    try:
        result = _run(code, audit)
        if audit:
            assert result.status == "blocked" and result.reason.startswith("blocked: open (writing"), result
        else:
            assert result.ok, result
        escaped = [t for t in targets if os.path.lexists(t)]
        assert escaped == [], (escaped, result.stdout)
    finally:
        for target in targets:
            if os.path.lexists(target):
                os.remove(target)


def _interpreter_roots() -> set[str]:
    """Top folders under /tmp on the way to the interpreter (a checkout cloned into /tmp, its venv)."""
    import sys

    roots = set()
    for d in [sys.prefix, sys.base_prefix, *plan.site_dirs()]:
        parts = Path(d).resolve().parts
        if len(parts) > 2 and parts[1] == "tmp":
            roots.add(parts[2])
    return roots


def test_a_file_planted_in_tmp_cannot_be_read_or_listed(audit):
    db = _planted_file()
    code = f"""
import os
try:
    print("LEAK", open({str(db)!r}).read(), flush=True)
except OSError as err:
    print("refused", type(err).__name__, flush=True)
print(sorted(os.listdir("/tmp")), flush=True)
"""
    try:
        result = _run(code, audit)
    finally:
        shutil.rmtree(db.parent)
    assert "SECRET" not in result.stdout and "SECRET" not in result.stderr, result
    if audit:
        assert result.status == "blocked" and result.reason.startswith("blocked: open (reading"), result
        return
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[0] == "refused FileNotFoundError", result.stdout
    listed = ast.literal_eval(lines[1])
    assert db.parent.name not in listed
    assert all(name.startswith("verl-sandbox-") or name in _interpreter_roots() for name in listed), listed


def test_listing_tmp_is_blocked_by_the_hook_and_empty_without_it(audit):
    result = _run("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('/tmp')))", audit)
    if audit:
        assert result.status == "blocked" and result.reason.startswith("blocked: os.listdir"), result
        return
    assert result.ok, result
    folder, listed = result.stdout.splitlines()
    own = [p.name for p in Path(folder).parents if p.parent == Path("/tmp")]
    # the run's own folder, and the way to an interpreter that lives under /tmp (mounted back read-only)
    assert set(ast.literal_eval(listed)) <= {*own, *_interpreter_roots()} and own, result.stdout


def test_tmp_is_hidden_even_when_the_interpreter_lives_under_it(monkeypatch):
    """An interpreter folder (a venv, site-packages) inside /tmp is mounted back read-only, and
    /tmp is still hidden (the plan used to leave /tmp alone then)."""
    iso = _kernel_isolation()
    fake_site = Path(tempfile.mkdtemp(prefix="verl-test-site-", dir="/tmp"))
    try:
        os.chmod(fake_site, 0o755)
        (fake_site / "planted_mod.py").write_text("VALUE = 'from-site'\n")
        os.chmod(fake_site / "planted_mod.py", 0o644)
        db = _planted_file()
        escape = Path("/tmp") / f"verl-sandbox-escape-{uuid.uuid4().hex}"
        real_site_dirs = plan.site_dirs
        monkeypatch.setattr(plan, "site_dirs", lambda: sorted({*real_site_dirs(), str(fake_site)}))
        plan._plan.cache_clear()
        try:
            code = f"""
import os, planted_mod
print(planted_mod.VALUE)
for attempt in (lambda: open({str(db)!r}).read(), lambda: open({str(escape)!r}, "x").write("x"),
                lambda: open({str(fake_site / "written.py")!r}, "w").write("x")):
    try:
        print("done", attempt(), flush=True)
    except OSError as err:
        print("refused", type(err).__name__, flush=True)
"""
            result = sandbox._run(code, QUICK, "", iso, audit=False)
        finally:
            plan._plan.cache_clear()
            shutil.rmtree(db.parent)
        assert result.ok, result
        lines = result.stdout.splitlines()
        assert lines[0] == "from-site", result.stdout  # the interpreter's folder is still there
        assert lines[1] == "refused FileNotFoundError" and lines[3].startswith("refused"), result.stdout
        assert not (fake_site / "written.py").exists()
        assert not escape.exists() and "SECRET" not in result.stdout
    finally:
        shutil.rmtree(fake_site)
        if os.path.lexists(escape):
            os.remove(escape)


def test_signals_to_other_processes_are_refused_without_the_hook():
    """The pid namespace and the uid: the parent is not even visible, a group kill ends only the program."""
    iso = sandbox_isolation()
    if not iso.namespaces:
        pytest.skip(f"needs a pid namespace; here: {iso.describe()}")
    killer = _run(f"import os\nos.kill({os.getpid()}, 0)", audit=False)
    assert killer.status == "error" and killer.reason.startswith(("ProcessLookupError", "PermissionError")), killer
    group = _run("import os, signal\nos.killpg(0, signal.SIGKILL)", audit=False)
    assert (group.status, group.reason) == ("killed", "killed by SIGKILL"), group
    assert run_python("print('still', 6 * 7)").stdout == "still 42\n"


def test_a_deep_world_writable_folder_is_read_only_for_the_program():
    """Folders too deep for the plan's scan: the root file system is read-only in the mount namespace."""
    iso = _kernel_isolation()
    if iso.user_namespace:
        pytest.skip("in a user namespace / is not remounted read-only (the program has the caller's permissions)")
    outer = Path("/var/lib") / f"verl-test-{uuid.uuid4().hex}"
    if os.stat("/var/lib").st_dev != os.stat("/").st_dev:
        pytest.skip("/var/lib is not on the root file system here")
    deep = outer / "deep" / "shared"
    deep.mkdir(parents=True)
    try:
        os.chmod(outer, 0o755)
        os.chmod(outer / "deep", 0o755)
        os.chmod(deep, 0o1777)
        result = _run(f"open({str(deep / 'escaped')!r}, 'w').write('x')", audit=False)
        assert result.status == "error" and result.reason.startswith("OSError: [Errno 30]"), result  # read-only file system
        assert list(deep.iterdir()) == []
    finally:
        shutil.rmtree(outer)
