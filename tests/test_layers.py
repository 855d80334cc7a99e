"""The layers and the kernel's layout described in CONTRIBUTING.md ("Layout") hold: the kernel never
imports Prefect, MLflow or the pipeline layer; dependencies point down only, between layers and between
the kernel's packages; the kernel's root holds only its face; a name has one import path; no import
cycles; no oversized modules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verl_core", "tasks", "flows")
# Each layer and the top-level names it may import from this project.
ALLOWED = {
    "kernel": {"verl_core"},
    "pipeline": {"verl_core"},
    "tasks": {"verl_core", "tasks"},
    "flows": {"verl_core", "tasks", "flows"},
}
MLFLOW_IN_KERNEL = {"verl_core.train.callbacks", "verl_core.train.traces"}  # the MLflow callback and its traces (lazy imports)

pytestmark = pytest.mark.fast


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module.startswith("verl_core.pipeline"):
        return "pipeline"
    return "kernel" if module.startswith("verl_core") else module.split(".")[0]


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def kernel_modules() -> list[str]:
    return [module_name(p) for p in project_files() if layer_of(module_name(p)) == "kernel"]


def test_no_kernel_file_imports_prefect_mlflow_or_the_pipeline_layer():
    offenders = []
    for path in project_files():
        module = module_name(path)
        if layer_of(module) != "kernel":
            continue
        for name in imports_of(path):
            top = name.split(".")[0]
            if (
                top in ("prefect", "flows", "tasks")
                or name.startswith("verl_core.pipeline")
                or (top == "mlflow" and module not in MLFLOW_IN_KERNEL)
            ):
                offenders.append(f"{module} imports {name}")
    assert not offenders, offenders


def test_importing_every_kernel_module_loads_neither_prefect_nor_mlflow_nor_the_pipeline():
    code = (
        f"import importlib, json, sys\nfor m in {kernel_modules()!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'flows', 'tasks')"
        " or m.startswith('verl_core.pipeline'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_dependencies_point_down_only():
    offenders = []
    for path in project_files():
        module = module_name(path)
        allowed = ALLOWED[layer_of(module)]
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in PACKAGES and top not in allowed:
                offenders.append(f"{module} imports {name}")
            if layer_of(module) == "pipeline" and top == "prefect":
                offenders.append(f"{module} imports {name} (the pipeline layer runs without Prefect)")
    assert not offenders, offenders


def test_no_import_cycles_between_project_modules():
    modules = {module_name(p): p for p in project_files()}
    graph = {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle of logic.
    graph = {
        m: {i for i in deps if not (modules[m].name == "__init__.py" and i.startswith(m + "."))} for m, deps in graph.items()
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in project_files() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


# The kernel's root: the package's face and what several packages share (see CONTRIBUTING.md, "Layout").
KERNEL_ROOT = {
    "verl_core",
    "verl_core.config",
    "verl_core.errors",
    "verl_core.evaluation",
    "verl_core.policies",
    "verl_core.processes",
}


def kernel_package(module: str) -> str:
    """``verl_core.rollout.worker`` -> ``rollout``; a root module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_kernel_root_holds_only_the_package_face():
    root = {m for m in kernel_modules() if m.count(".") <= 1 and not (ROOT / m.replace(".", "/")).is_dir()} | {"verl_core"}
    assert root == KERNEL_ROOT, sorted(root ^ KERNEL_ROOT)


def test_kernel_packages_depend_on_each_other_one_way():
    """No two kernel packages import each other (e.g. agents and rewards, evaluation and algorithms)."""
    modules = {module_name(p): p for p in project_files() if layer_of(module_name(p)) == "kernel"}
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        if m == "verl_core":
            continue  # the public API imports from everywhere by design
        for name in imports_of(p):
            if name.startswith("verl_core.") and name.split(".")[0] == "verl_core" and layer_of(name) == "kernel":
                a, b = kernel_package(m), kernel_package(name)
                if a != b and b not in ("config", "errors"):
                    graph.setdefault(a, set()).add(b)
    both_ways = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, set())})
    assert not both_ways, both_ways


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_a_name_is_imported_from_the_module_that_defines_it():
    """One module, one name: no module re-exports another's names (packages' ``__init__`` aside, which are
    their package's public API)."""
    files = {module_name(p): p for p in project_files() + sorted((ROOT / "tests").glob("*.py"))}
    offenders = []
    for path in files.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_core.")):
                continue
            source = files.get(node.module)
            if source is None or source.name == "__init__.py":
                continue
            defined = _top_level_names(source)
            for alias in node.names:
                if alias.name not in defined and f"{node.module}.{alias.name}" not in files:
                    offenders.append(
                        f"{path.relative_to(ROOT)} imports {alias.name} from {node.module}, which does not define it"
                    )
    assert not offenders, offenders
