"""A GGUF file as a model source: dequantised once into a cached Hugging Face folder.

Why a folder: every stage (SFT, reward model, reference, policy, rollout backends) and every process loads
models with plain ``from_pretrained(folder)``, so a ``.gguf`` path given anywhere a model path is taken is
turned into such a folder once (fp32 safetensors, tokenizer, ``chat_template.jinja``) and is an ordinary
folder from then on. :func:`verl_core.modeling.loading.check_model_source` is the one place that calls
:func:`converted_folder`.

Cache: ``$VERL_CORE_MODEL_CACHE``, else ``<VERL_CORE_CACHE or ~/.cache/verl_core>/models``, one folder per
file named ``gguf-<first 16 hex of the sha256 of its bytes>-v<CONVERT_VERSION>``: the key is the content alone,
so a renamed or copied file reuses the folder and an edited one does not (``verl_core_gguf.json`` inside names
the source). The folder is written under a temporary name and renamed into place (a half-written folder is
never used), one conversion of a file at a time (a file lock beside its folder), and an error leaves no folder
behind (:func:`verl_core.processes.build_folder_once`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from verl_core.bundled.tiny_model import default_cache_dir
from verl_core.modeling.model_files import ModelLoadError
from verl_core.processes import build_folder_once

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
CACHE_ENV = "VERL_CORE_MODEL_CACHE"
INSTALL_HINT = "pip install 'verl-core[gguf]'"
SOURCE_RECORD = "verl_core_gguf.json"  # provenance written into each converted folder
CONVERT_VERSION = 1  # bump when the conversion's output changes, so older folders are not reused
_HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
_hashes: dict[tuple, str] = {}  # (path, size, mtime, inode) -> sha256: a process resolves a path several times


def model_cache_dir() -> Path:
    """Where converted folders live (same convention as the tiny model's ``VERL_CORE_CACHE``)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else default_cache_dir() / "models"


def _head(path: Path, n: int = 4) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def looks_like_gguf(path: str | os.PathLike) -> bool:
    """A file named ``*.gguf`` or starting with the GGUF magic: one the caller means as a GGUF model."""
    p = Path(path).expanduser()
    return p.is_file() and (p.suffix.lower() == GGUF_SUFFIX or _head(p) == GGUF_MAGIC)


def content_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file's bytes (not its name), remembered per (path, size, mtime) within the process."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _hashes:
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def require_gguf(path: str | os.PathLike):
    """The ``gguf`` package, or an error naming the file and the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            f"{path}: reading a GGUF model needs the gguf package; install it with {INSTALL_HINT} (or pip install gguf)"
        ) from None
    return gguf


def check_gguf_file(path: str | os.PathLike) -> str:
    """Validate a GGUF file before anything is written; returns its ``general.architecture``.

    Checked in order of cost: the 4-byte magic, the header length, the ``gguf`` package, then the full
    metadata and tensor table, with every tensor's data inside the file (a truncated download fails here,
    naming the file, rather than deep inside transformers).
    """
    p = Path(path).expanduser()
    head = _head(p, _HEADER_BYTES)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{p} is not a GGUF file: it starts with {head[:4]!r}, a GGUF file starts with {GGUF_MAGIC!r}")
    if len(head) < _HEADER_BYTES:
        raise ModelLoadError(f"{p} is a truncated GGUF file: {len(head)} bytes, shorter than the {_HEADER_BYTES}-byte header")
    gguf = require_gguf(p)
    size = p.stat().st_size
    try:
        reader = gguf.GGUFReader(p)
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception as err:  # numpy/struct errors from a cut-off or corrupt header
        raise ModelLoadError(f"{p} is a truncated or corrupt GGUF file: {type(err).__name__}: {err}") from None
    if ends and max(ends) > size:
        raise ModelLoadError(f"{p} is a truncated GGUF file: its tensors need {max(ends)} bytes, the file has {size}")
    if not arch:
        raise ModelLoadError(f"{p}: the GGUF file names no general.architecture")
    return arch


def _done(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / SOURCE_RECORD).is_file()


def converted_folder(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder for GGUF file ``path``, dequantised on first use and reused after.

    Raises :class:`ModelLoadError` naming the file when it is not GGUF, is truncated, needs the ``gguf``
    package, or holds an architecture transformers cannot dequantise; nothing is cached then.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ModelLoadError(f"GGUF file does not exist: {path}")
    if _head(file) != GGUF_MAGIC:  # before hashing: a large non-GGUF file fails at once
        check_gguf_file(file)
    root = Path(cache_dir).expanduser() if cache_dir else model_cache_dir()
    sha = content_sha256(file)
    target = root / f"gguf-{sha[:16]}-v{CONVERT_VERSION}"
    if _done(target):
        return target
    arch = check_gguf_file(file)
    return build_folder_once(target, lambda tmp: _convert(file, tmp, arch, sha), done=_done)


def _convert(file: Path, out: Path, arch: str, sha: str) -> None:
    """Dequantise with transformers' own GGUF reader and save a plain fp32 folder into ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.train.progress import quiet_library_bars

    quiet_library_bars()
    try:
        with _tensor_progress_as_lines():
            tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
            model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except Exception as err:
        if "not supported" in str(err):
            raise ModelLoadError(
                f"{file}: GGUF architecture {arch!r} is one transformers {transformers.__version__} cannot dequantise "
                f"({err}); convert it to a Hugging Face folder another way"
            ) from None
        raise ModelLoadError(f"cannot read GGUF file {file}: {type(err).__name__}: {err}") from None
    # The GGUF quantizer marks the model as not serializable; the weights are already plain fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "source": str(file),
        "sha256": sha,
        "architecture": arch,
        "convert_version": CONVERT_VERSION,
        "transformers": transformers.__version__,
        "gguf": _gguf_version(),
    }
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def _tensor_progress_as_lines():
    """Off a terminal, transformers' per-tensor GGUF bar (a bare ``tqdm``, which ``quiet_library_bars`` does
    not reach) would write hundreds of carriage-return frames into a log: show it as progress lines."""
    from verl_core.train.progress import LineProgress, on_terminal

    try:
        import transformers.modeling_gguf_pytorch_utils as reader
    except ImportError:  # pragma: no cover - moved in another transformers: its bar stays
        reader = None
    if on_terminal() or reader is None or not hasattr(reader, "tqdm"):
        yield
        return

    def lines(items, desc: str = "", **_: object):
        items = list(items)
        with LineProgress(len(items), desc=desc.rstrip(". ") or "GGUF tensors", unit="tensor") as bar:
            for item in items:
                yield item
                bar.update()

    original, reader.tqdm = reader.tqdm, lines
    try:
        yield
    finally:
        reader.tqdm = original


def _gguf_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - it was imported a moment ago
        return None
