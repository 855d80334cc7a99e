"""A table of bad inputs a user can give (issue 18): each raises the project's error class with a
message that names the file and the row/line or the key; the failure leaves no file behind that a
rerun would pick up; and the same call with the input fixed succeeds."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from verl_core.config import ConfigError
from verl_core.data import load_rows, tokenize_pairs, tokenize_prompts, tokenize_sft, tokenize_unpaired
from verl_core.data.errors import DataError
from verl_core.errors import TrackingError, UserError, WorkdirError
from verl_core.modeling.loading import load_causal_lm, load_tokenizer
from verl_core.modeling.model_files import ModelLoadError
from verl_core.pipeline.config import load_pipeline_config
from verl_core.train.state_io import CheckpointError, refuse_pickles

ROOT = Path(__file__).resolve().parents[1]
GOOD_SFT = '{"prompt": "Q: 1+1=", "completion": " 2"}\n{"prompt": "Q: 2+2=", "completion": " 4"}\n'
GOOD_KTO = '{"prompt": "Q:", "completion": " 2", "label": true}\n{"prompt": "Q:", "completion": " 5", "label": false}\n'


@dataclass
class Case:
    """``files`` (name -> content) are written into a fresh folder; ``run(folder, tokenizer)`` uses them;
    ``fixed`` replaces files to make the same call succeed."""

    name: str
    error: type[UserError]
    match: str
    files: dict[str, str | bytes | None]  # None deletes
    run: Callable[[Path, object], object]
    fixed: dict[str, str | bytes]


def rows(name: str) -> Callable:
    return lambda d, tok: load_rows(str(d / name))


def tokenized(fn, name: str) -> Callable:
    return lambda d, tok: fn(str(d / name), tok)


def config(*overrides: str, file: str | None = None) -> Callable:
    return lambda d, tok: load_pipeline_config(d / file if file else ROOT / "configs" / "default.yaml", list(overrides))


def preflight_of(workdir: str, uri: str | None = None) -> Callable:
    def run(d, tok):
        from verl_core.pipeline.preflight import preflight

        sets = [f"workdir={d / workdir}", f"tracking.uri={uri or f'sqlite:///{d}/mlflow.db'}"]
        return preflight(load_pipeline_config(None, sets))

    return run


class _Payload:
    def __reduce__(self):
        return (exec, ("open('PAYLOAD_RAN', 'w').write('ran')",))


CASES = [
    # -- data files: the row or line, and the field, are named --
    Case(
        "int in a text column",
        DataError,
        r"d\.jsonl line 2: field 'completion' is a number",
        {"d.jsonl": '{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": 4}\n'},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "list in a text column",
        DataError,
        r"d\.jsonl line 2: field 'prompt' is a list",
        {"d.jsonl": '{"prompt": "a"}\n{"prompt": ["x"]}\n'},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "truncated JSONL line",
        DataError,
        r"d\.jsonl line 2: not valid JSON",
        {"d.jsonl": GOOD_SFT.splitlines()[0] + '\n{"prompt": "Q: 2+2=", "compl'},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "garbage JSONL line",
        DataError,
        r"d\.jsonl line 3: not valid JSON",
        {"d.jsonl": GOOD_SFT + "garbage\n"},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "JSONL line not an object",
        DataError,
        r"d\.jsonl line 1: expected a JSON object, got list",
        {"d.jsonl": "[1, 2]\n"},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "invalid UTF-8",
        DataError,
        r"d\.jsonl line 2: not valid UTF-8",
        {"d.jsonl": b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff\xfe"}\n'},
        rows("d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case("empty JSONL file", DataError, r"d\.jsonl is empty", {"d.jsonl": ""}, rows("d.jsonl"), {"d.jsonl": GOOD_SFT}),
    Case(
        "JSON not a list",
        DataError,
        r"d\.json: expected a list of objects",
        {"d.json": '"text"'},
        rows("d.json"),
        {"d.json": '[{"prompt": "a", "completion": "b"}]'},
    ),
    Case(
        "JSON syntax error",
        DataError,
        r"d\.json line 3: not valid JSON",
        {"d.json": '[\n{"prompt": "a"},\n{"prompt": }\n]'},
        rows("d.json"),
        {"d.json": '[{"prompt": "a", "completion": "b"}]'},
    ),
    Case(
        "CSV quote left open",
        DataError,
        r"d\.csv line 3: malformed CSV",
        {"d.csv": 'prompt,completion\nQ: 1+1=,2\n"Q: 2+2=,4\n'},
        rows("d.csv"),
        {"d.csv": 'prompt,completion\nQ: 1+1=,2\n"Q: 2+2=",4\n'},
    ),
    Case(
        "CSV quote merging two records",
        DataError,
        r"d\.csv line 2: 3 fields, the header has 2 \(this record runs to line 3",
        {"d.csv": 'prompt,completion\n"Q: 1+1=,2\nQ: 2+2=",4,x\n'},
        rows("d.csv"),
        {"d.csv": "prompt,completion\nQ: 1+1=,2\nQ: 2+2=,4\n"},
    ),
    Case(
        "CSV record with too many fields",
        DataError,
        r"d\.csv line 3: 3 fields, the header has 2",
        {"d.csv": "prompt,completion\nQ: 1+1=,2\nQ: 2+2=,4,5\n"},
        rows("d.csv"),
        {"d.csv": "prompt,completion\nQ: 1+1=,2\nQ: 2+2=,4\n"},
    ),
    Case(
        "CSV label not a boolean",
        DataError,
        r"d\.csv line 2: field 'label' must be true or false, got 'yes'",
        {"d.csv": "prompt,completion,label\nQ:,2,yes\n"},
        rows("d.csv"),
        {"d.csv": "prompt,completion,label\nQ:,2,true\n"},
    ),
    Case(
        "unknown file type",
        DataError,
        r"d\.txt: unknown file type",
        {"d.txt": "hello"},
        rows("d.txt"),
        {"d.txt": "hello", "d.jsonl": GOOD_SFT},
    ),
    Case(
        "missing data path",
        DataError,
        r"data path does not exist: .*missing\.jsonl",
        {},
        rows("missing.jsonl"),
        {"missing.jsonl": GOOD_SFT},
    ),
    # -- rows checked after loading: the file, the row and its line --
    Case(
        "KTO label 'yes'",
        DataError,
        r"d\.jsonl line 2: field 'label' is a str \('yes'\), but it is a bool at line 1",
        {"d.jsonl": GOOD_KTO.replace("false", '"yes"')},
        tokenized(tokenize_unpaired, "d.jsonl"),
        {"d.jsonl": GOOD_KTO},
    ),
    Case(
        "KTO label 2",
        DataError,
        r"d\.jsonl row 0 \(line 1\): field 'label' must be true or false \(a JSON boolean\), got 2",
        {"d.jsonl": GOOD_KTO.replace("true", "2").replace("false", "3")},
        tokenized(tokenize_unpaired, "d.jsonl"),
        {"d.jsonl": GOOD_KTO},
    ),
    Case(
        "KTO label 1 (not a boolean)",
        DataError,
        r"d\.jsonl row 0 \(line 1\): field 'label' must be true or false \(a JSON boolean\), got 1",
        {"d.jsonl": GOOD_KTO.replace("true", "1").replace("false", "0")},
        tokenized(tokenize_unpaired, "d.jsonl"),
        {"d.jsonl": GOOD_KTO},
    ),
    Case(
        "KTO label missing",
        DataError,
        r"d\.jsonl row 0 \(line 1\): missing field 'label'",
        {"d.jsonl": '{"prompt": "Q:", "completion": " 2"}\n'},
        tokenized(tokenize_unpaired, "d.jsonl"),
        {"d.jsonl": GOOD_KTO},
    ),
    Case(
        "SFT row without text fields",
        DataError,
        r"d\.jsonl row 1 \(line 3\): missing field 'completion'",
        {"d.jsonl": GOOD_SFT.replace("\n", "\n\n", 1).replace('"completion": " 4"', '"answer": " 4"')},
        tokenized(tokenize_sft, "d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "identical chosen and rejected",
        DataError,
        r"d\.jsonl row 0 \(line 1\): 'chosen' and 'rejected' are identical",
        {"d.jsonl": '{"prompt": "Q:", "chosen": " 2", "rejected": " 2"}\n'},
        tokenized(tokenize_pairs, "d.jsonl"),
        {"d.jsonl": '{"prompt": "Q:", "chosen": " 2", "rejected": " 3"}\n'},
    ),
    Case(
        "empty prompt",
        DataError,
        r"d\.jsonl row 0 \(line 1\): field 'prompt' is empty",
        {"d.jsonl": '{"prompt": "", "completion": " 2"}\n'},
        tokenized(tokenize_sft, "d.jsonl"),
        {"d.jsonl": GOOD_SFT},
    ),
    Case(
        "ground truth a mapping",
        DataError,
        r"d\.jsonl row 0 \(line 1\): field 'ground_truth' must be a string or number",
        {"d.jsonl": '{"prompt": "Q:", "ground_truth": {"a": 1}}\n'},
        tokenized(tokenize_prompts, "d.jsonl"),
        {"d.jsonl": '{"prompt": "Q:", "ground_truth": "2"}\n'},
    ),
    # -- configuration: the key (and the file or override) --
    Case(
        "infinite learning rate",
        ConfigError,
        r"sft\.learning_rate: Input should be a finite number",
        {},
        config("sft.learning_rate=.inf"),
        {},
    ),
    Case(
        "NaN max_grad_norm",
        ConfigError,
        r"policy_optimisation\.dpo\.max_grad_norm: Input should be a finite number",
        {},
        config("policy_optimisation.dpo.max_grad_norm=.nan"),
        {},
    ),
    Case("unknown key", ConfigError, r"unknown key 'sft\.max_stepz'", {}, config("sft.max_stepz=3"), {}),
    Case(
        "override not YAML",
        ConfigError,
        r"override 'sft\.max_steps=\[': the value is not valid YAML",
        {},
        config("sft.max_steps=["),
        {},
    ),
    Case(
        "YAML syntax error",
        ConfigError,
        r"(?s)c\.yaml is not valid YAML.*c\.yaml\", line 3",
        {"c.yaml": "sft:\n  max_steps: [\n"},
        config(file="c.yaml"),
        {"c.yaml": "sft:\n  max_steps: 3\n"},
    ),
    Case(
        "YAML top level a list",
        ConfigError,
        r"c\.yaml: top level must be a mapping",
        {"c.yaml": "- a\n"},
        config(file="c.yaml"),
        {"c.yaml": "name: x\n"},
    ),
    Case(
        "config file missing",
        ConfigError,
        r"config file not found: .*c\.yaml",
        {},
        config(file="c.yaml"),
        {"c.yaml": "name: x\n"},
    ),
    # -- models and checkpoints: the folder or file --
    Case(
        "model folder without config.json",
        ModelLoadError,
        r"model folder .*/m has no config\.json",
        {"m/readme.txt": "x"},
        lambda d, tok: load_causal_lm(d / "m"),
        {"m": "TINY"},
    ),
    Case(
        "truncated model.safetensors",
        ModelLoadError,
        r"cannot load AutoModelForCausalLM from .*/m: ",
        {"m": "TINY", "m/model.safetensors": b"\x10\x00"},
        lambda d, tok: load_causal_lm(d / "m"),
        {"m": "TINY"},
    ),
    Case(
        "hostile pytorch_model.bin",
        ModelLoadError,
        r"cannot load AutoModelForCausalLM from .*/m: .*Unpickl",
        {"m": "TINY", "m/model.safetensors": None, "m/pytorch_model.bin": pickle.dumps(_Payload())},
        lambda d, tok: load_causal_lm(d / "m"),
        {"m": "TINY"},
    ),
    Case(
        "missing local model path",
        ModelLoadError,
        r"model path does not exist: .*typo",
        {},
        lambda d, tok: load_tokenizer(d / "typo"),
        {"typo": "TINY"},
    ),
    Case(
        "pickle in a checkpoint",
        CheckpointError,
        r"holds custom_checkpoint_0\.pkl.*no pickles",
        {"c/custom_checkpoint_0.pkl": pickle.dumps(_Payload()), "c/state.json": "{}"},
        lambda d, tok: refuse_pickles(d / "c"),
        {"c/state.json": "{}"},
    ),
    # -- workdir and tracking URI: checked in seconds, before training --
    Case("workdir is a file", WorkdirError, r"workdir .*/w is a file, not a folder", {"w": "x"}, preflight_of("w"), {}),
    Case("workdir below a file", WorkdirError, r"workdir .*/f/w is not writable", {"f": "x"}, preflight_of("f/w"), {}),
    Case(
        "unreachable tracking server",
        TrackingError,
        r"tracking URI http://127\.0\.0\.1:9 cannot be reached",
        {},
        preflight_of("w", "http://127.0.0.1:9"),
        {},
    ),
]
FIX_OVERRIDES = {  # config cases are fixed by a different call, not different files
    "infinite learning rate": config("sft.learning_rate=1e-4"),
    "NaN max_grad_norm": config("policy_optimisation.dpo.max_grad_norm=1.0"),
    "unknown key": config("sft.max_steps=3"),
    "override not YAML": config("sft.max_steps=3"),
    "unreachable tracking server": preflight_of("w"),
    "unknown file type": rows("d.jsonl"),
    "workdir is a file": preflight_of("w2"),
    "workdir below a file": preflight_of("w2"),
}


def _write(folder: Path, files: dict[str, str | bytes | None], tiny_path: Path) -> None:
    for name, content in files.items():
        path = folder / name
        if content is None:
            path.unlink()
            continue
        if content == "TINY":
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(tiny_path, path)
            continue
        if path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def test_the_table_has_at_least_30_cases():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_named_leaves_nothing_and_the_fixed_input_runs(case, tmp_path, tiny_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the pickle payload would write PAYLOAD_RAN here
    tok = load_tokenizer(tiny_path)
    _write(tmp_path, case.files, tiny_path)
    before = _files(tmp_path)
    with pytest.raises(case.error, match=case.match) as err:
        case.run(tmp_path, tok)
    assert isinstance(err.value, UserError)
    assert _files(tmp_path) == before, "the failed call left files a rerun could pick up"
    assert not (tmp_path / "PAYLOAD_RAN").exists()
    _write(tmp_path, case.fixed, tiny_path)
    if case.name == "pickle in a checkpoint":
        (tmp_path / "c" / "custom_checkpoint_0.pkl").unlink()
    FIX_OVERRIDES.get(case.name, case.run)(tmp_path, tok)
