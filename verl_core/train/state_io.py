"""Training state as safetensors + JSON, never pickles.

A pickle can run any code when it is loaded, so a checkpoint folder copied from shared storage
must not hold one. :func:`save_tree` splits a nested state (the optimizer's ``state_dict``, a
scheduler's, RNG states, counters) into its tensors, written with safetensors, and a JSON
skeleton that says where each tensor goes; :func:`load_tree` rebuilds it. The skeleton keeps
what JSON alone would lose: integer dict keys (optimizer state is keyed by parameter index),
tuples, and numpy arrays (numpy's RNG state).

:func:`refuse_pickles` is the loader's first step: a folder holding any file that is not
safetensors or JSON is refused with :class:`CheckpointError` naming the file, before anything is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_core.errors import UserError

SAFE_SUFFIXES = (".safetensors", ".json")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (a pickle in it, a truncated file, a mismatch); names the file."""


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        # clone: safetensors refuses views and shared storage (tied weights, optimizer views)
        tensors[name] = obj.detach().to("cpu").clone().contiguous()
        return {"tensor": name}
    if isinstance(obj, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "iu" else obj.copy())
        return {"ndarray": name, "dtype": obj.dtype.str}
    if isinstance(obj, dict):
        return {"dict": [[k, _encode(v, tensors, f"{where}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return {"list": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot save {where}: a {type(obj).__name__} is neither a tensor nor plain data")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "ndarray" in node:
        return tensors[node["ndarray"]].numpy().astype(np.dtype(node["dtype"]))
    if "dict" in node:
        return {k: _decode(v, tensors) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_decode(v, tensors) for v in node["tuple"])
    return [_decode(v, tensors) for v in node["list"]]


def save_tree(state: Any, folder: Path, name: str) -> None:
    """Write ``state`` as ``folder/name.safetensors`` (its tensors) and ``folder/name.json`` (the rest)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, name)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def load_tree(folder: Path, name: str) -> Any:
    """Inverse of :func:`save_tree`; no code from the files runs."""
    skeleton = json.loads(read_text(folder / f"{name}.json"))
    return _decode(skeleton, load_tensors(folder / f"{name}.safetensors"))


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read checkpoint file {path}: {err}") from None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file; a missing or truncated file is a :class:`CheckpointError` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete: delete its folder")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint file {path} is damaged ({err}); delete its folder to resume from an earlier one"
        ) from None


def refuse_pickles(folder: Path) -> None:
    """Refuse a checkpoint folder that holds anything but safetensors and JSON (a planted pickle, or a
    checkpoint of an older format that used pickles), naming the first such file."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix not in SAFE_SUFFIXES:
            raise CheckpointError(
                f"checkpoint {folder} holds {path.name}, which is not safetensors or JSON. verl_core checkpoints "
                "hold no pickles and such a file can run code when loaded, so the checkpoint is refused and "
                "nothing was read from it. Delete that checkpoint folder (or the file, if you did not mean "
                "it to be there) to resume from an earlier one, or set resume=False."
            )


# -- the engine's state -------------------------------------------------------------------------
MODEL_FILE = "model.safetensors"
TRAINING_STATE = "training_state"  # optimizer, scheduler, counters, trainer states (main process)


def rng_state() -> dict[str, Any]:
    import random

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(accelerator, model, states: dict[str, Any], folder: Path) -> None:
    """Write the model weights, ``states`` (name -> object with ``state_dict``) and this process's RNG
    state into ``folder``. Every process calls it (gathering a sharded model needs all of them)."""
    from safetensors.torch import save_file

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()}, str(folder / MODEL_FILE))
        save_tree({name: obj.state_dict() for name, obj in states.items()}, folder, TRAINING_STATE)
    save_tree(rng_state(), folder, f"rng-{accelerator.process_index}")


def load_training_state(accelerator, model, states: dict[str, Any], folder: Path) -> None:
    """Inverse of :func:`save_training_state`; refuses a folder with a pickle before reading anything."""
    refuse_pickles(folder)
    weights = load_tensors(folder / MODEL_FILE)
    try:
        accelerator.unwrap_model(model).load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(f"{folder / MODEL_FILE} does not fit this model: {str(err)[:500]}") from None
    saved = load_tree(folder, TRAINING_STATE)
    missing = sorted(set(states) - set(saved))
    if missing:
        raise CheckpointError(f"checkpoint {folder} has no state for {', '.join(missing)}; it was made by a different trainer")
    for name, obj in states.items():
        obj.load_state_dict(saved[name])
    rng = folder / f"rng-{accelerator.process_index}.json"
    if rng.is_file():  # a run on more processes than the checkpoint's keeps its own seeded streams there
        set_rng_state(load_tree(folder, f"rng-{accelerator.process_index}"))
