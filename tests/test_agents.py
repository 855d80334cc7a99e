"""Agentic RL kernel: tool calls parsed and answered (bad ones as tool errors), the chat format of tool
turns, the episode loop over a backend (batching of unequal episodes, masks, limits, seeds)."""

from __future__ import annotations

import pytest
import torch

from verl_core.agents import AgentLoop, AgentSettings, ToolCall, build_agent_loop, call_tools, episode_metrics, tasks
from verl_core.agents.chat import ChatFormat
from verl_core.agents.environments import EpisodeSampler, tokenize_agent_prompts
from verl_core.agents.episodes import episode_seed, trajectory_table
from verl_core.agents.parsers import parse_hermes, parse_pythonic
from verl_core.agents.tools import CALCULATOR, TOOLS, ToolResult, calculate
from verl_core.config import ConfigError
from verl_core.rollout.contract import RolloutBatch, SamplingParams, concat_rollouts

pytestmark = pytest.mark.fast


class ScriptedBackend:
    """A backend that continues each episode with the next turn of its script (text + EOS), keyed by the
    episode's prompt; it records the number of histories of every call."""

    def __init__(self, tok, scripts: dict[tuple, list[str]]):
        self.tok, self.scripts, self.calls = tok, scripts, []

    def generate(self, prompt_ids, params, seed=0):
        self.calls.append(len(prompt_ids))
        eos, header, rows = self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|assistant|>"), []
        for history in prompt_ids:
            key = next(k for k in self.scripts if tuple(history[: len(k)]) == k)
            turn = sum(t == header for t in history[len(key) :])  # each tool turn ends with the next assistant header
            rows.append(
                self.tok(self.scripts[key][turn], add_special_tokens=False)["input_ids"][: params.max_new_tokens - 1] + [eos]
            )
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        return RolloutBatch(
            prompt_ids=torch.zeros(len(rows), 1, dtype=torch.long),
            prompt_mask=torch.ones(len(rows), 1, dtype=torch.long),
            response_ids=torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            response_mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            logprobs=torch.tensor([[-0.5] * len(r) + [0.0] * (width - len(r)) for r in rows]),
            group_index=torch.arange(len(rows)),
            finished=torch.ones(len(rows), dtype=torch.bool),
        )

    def sync_weights(self, model):
        pass


def _loop(tok, **settings) -> AgentLoop:
    return build_agent_loop(AgentSettings(environment="calculator_arithmetic", **settings), tok, 48)


# --- parsing and calling ---------------------------------------------------------------------


def test_hermes_calls_are_parsed_and_unreadable_ones_become_errors():
    ok = parse_hermes('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>')
    assert ok.calls == [ToolCall("calculator", {"expression": "2 * 3"})] and not ok.errors
    stringified = parse_hermes('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert stringified.calls == [ToolCall("python", {"code": "print(1)"})]
    two = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in two.calls] == ["a", "b"]
    assert "not valid JSON" in parse_hermes("<tool_call>{name: calculator}</tool_call>").errors[0]
    assert "no closing" in parse_hermes('<tool_call>{"name": "calculator"').errors[0]
    assert "needs" in parse_hermes('<tool_call>["calculator"]</tool_call>').errors[0]
    assert not parse_hermes("#### 18").wants_tools


def test_pythonic_calls_are_parsed_and_unreadable_ones_become_errors():
    assert parse_pythonic('[calculator(expression="37 * 4 + 19")]').calls == [
        ToolCall("calculator", {"expression": "37 * 4 + 19"})
    ]
    assert "keyword arguments only" in parse_pythonic("[calculator(37 * 4)]").errors[0]
    assert "literals" in parse_pythonic("[calculator(expression=x)]").errors[0]
    assert "not a Python list" in parse_pythonic('[calculator(expression="1 +').errors[0]
    assert not parse_pythonic("#### 18").wants_tools and not parse_pythonic("[1, 2]").wants_tools


def test_bad_calls_are_answered_as_tool_errors_never_raised():
    tools = {"calculator": CALCULATOR}
    results = call_tools(
        [
            ToolCall("calculator", {"expression": "37 * 4 + 19"}),
            ToolCall("shell", {"cmd": "ls"}),
            ToolCall("calculator", {}),
            ToolCall("calculator", {"expression": 3}),
            ToolCall("calculator", {"expression": "1", "base": 2}),
            ToolCall("calculator", {"expression": "__import__('os')"}),
            ToolCall("calculator", {"expression": "9 ** 9 ** 9"}),
            ToolCall("calculator", {"expression": "1 / 0"}),
        ],
        tools,
    )
    assert results[0].ok and results[0].text == "167"
    assert [r.ok for r in results[1:]] == [False] * 7
    assert "unknown tool 'shell'" in results[1].text and "available: calculator" in results[1].text
    assert "missing required argument 'expression'" in results[2].text
    assert "must be string" in results[3].text and "unexpected argument 'base'" in results[4].text
    assert "not arithmetic" in results[5].text and "too large" in results[6].text and "ZeroDivisionError" in results[7].text


def test_calculator_and_tool_schemas():
    assert calculate("(2 + 3) * 4 - 6 / 3") == "18" and calculate("-7 // 2") == "-4"
    schema = TOOLS["calculator"].schema()
    assert schema["type"] == "function" and schema["function"]["parameters"]["required"] == ["expression"]
    assert set(TOOLS) >= {"calculator", "python"}


def test_unknown_names_in_the_settings_are_rejected_naming_the_key():
    from verl_core.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"environment: .*unknown environment 'nope'"):
        GRPOConfig.from_dict({"environment": "nope"})
    with pytest.raises(ConfigError, match=r"tools: .*unknown tool 'shell'"):
        GRPOConfig.from_dict({"environment": "calculator_arithmetic", "tools": ["shell"]})
    with pytest.raises(ConfigError, match=r"tool_parser: .*unknown tool-call parser"):
        GRPOConfig.from_dict({"environment": "calculator_arithmetic", "tool_parser": "xml"})
    with pytest.raises(ConfigError, match="need an environment"):
        GRPOConfig.from_dict({"tools": ["calculator"]})


# --- chat format -----------------------------------------------------------------------------


def test_tool_turns_follow_the_chat_template_after_the_policys_eos(tok):
    chat = ChatFormat(tok, [CALCULATOR.schema()])
    assert chat.prompt_text("Q") == "<|user|>\nQ<|end|>\n<|assistant|>\n"
    assert chat.tool_text([ToolResult("167")]) == "\n<|tool|>\n167<|end|>\n<|assistant|>\n"
    # a Qwen-style template that renders tools into the system prompt and results as <tool_response>
    qwen = tok.__class__.from_pretrained(tok.name_or_path)
    qwen.chat_template = (
        "{% if tools %}<|system|>\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|end|>\n{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "<|user|>\n<tool_response>\n{{ m['content'] }}\n</tool_response><|end|>\n"
        "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    chat = ChatFormat(qwen, [CALCULATOR.schema()])
    assert chat.prompt_text("Q") == "<|system|>\ncalculator;<|end|>\n<|user|>\nQ<|end|>\n<|assistant|>\n"
    assert chat.tool_text([ToolResult("1"), ToolResult("2")]) == (
        "\n<|user|>\n<tool_response>\n1\n</tool_response><|end|>\n<|user|>\n<tool_response>\n2\n</tool_response><|end|>\n<|assistant|>\n"
    )
    qwen.chat_template = None  # a base model: plain text
    plain = ChatFormat(qwen)
    assert plain.prompt_text("Q") == "Q" and plain.tool_text([ToolResult("5")]) == "\n<tool_response>\n5\n</tool_response>\n"


def test_the_sft_rows_are_the_tokens_of_a_correct_episode(tok):
    """The bundled task's SFT rows (chat messages, one row per assistant turn) tokenize to exactly the
    token history the episode loop builds for the correct episode: what SFT teaches is what RL continues."""
    from verl_core.data import tokenize_sft

    problem = tasks.train_problems(1)[0]
    loop = _loop(tok)
    prompt = loop.chat.prompt_ids(tasks.episode_messages(problem)[:1])
    backend = ScriptedBackend(tok, {tuple(prompt): [problem.call, problem.final]})
    batch, episodes = loop.run(backend, [prompt], SamplingParams(max_new_tokens=48), 0)
    rows = tokenize_sft(tasks.sft_rows(2, tool_fraction=1.0), tok, 256)
    assert rows[0]["prompt_ids"] == prompt
    second = rows[1]["prompt_ids"] + rows[1]["completion_ids"]
    history = prompt + episodes[0].response
    assert second[: len(history)] == history  # the row also trains the "\n" the template puts after <|end|>
    assert episodes[0].finished and episodes[0].tool_calls == 1 and episodes[0].tool_errors == 0


# --- the episode loop ------------------------------------------------------------------------


def _three_episodes(tok):
    loop = _loop(tok)
    prompts = [loop.chat.prompt_ids(q) for q in ("one", "two", "three")]
    scripts = {
        tuple(prompts[0]): ["#### 5"],  # answers at once
        tuple(prompts[1]): ['[calculator(expression="2 + 3")]', "#### 5"],  # one call
        tuple(prompts[2]): ['[calculator(expression="2 +)]', "[nope(x=1)]", "#### 6"],  # two bad calls: max_turns 3
    }
    return loop, prompts, ScriptedBackend(tok, scripts)


def test_every_active_episode_advances_one_turn_per_call_and_finished_ones_drop_out(tok):
    loop, prompts, backend = _three_episodes(tok)
    batch, episodes = loop.run(backend, prompts, SamplingParams(max_new_tokens=48), 0)
    assert backend.calls == [3, 2, 1]
    assert [e.policy_turns for e in episodes] == [1, 2, 3]
    assert [e.finished for e in episodes] == [True, True, True] and batch.finished.tolist() == [True, True, True]
    assert [e.tool_calls for e in episodes] == [0, 1, 2] and [e.tool_errors for e in episodes] == [0, 0, 2]
    assert episodes[1].turns[1] == {"role": "tool", "results": ["5"], "ok": [True]}
    assert (
        "not a Python list" in episodes[2].turns[1]["results"][0] and "unknown tool 'nope'" in episodes[2].turns[3]["results"][0]
    )
    m = episode_metrics(episodes)
    assert m["agent/turns_mean"] == 2.0 and m["agent/tool_calls_per_episode"] == 1.0
    assert m["agent/tool_errors_per_episode"] == pytest.approx(2 / 3) and m["agent/truncated_fraction"] == 0.0


def test_only_policy_tokens_carry_the_loss_mask_and_tool_tokens_are_context(tok):
    loop, prompts, backend = _three_episodes(tok)
    batch, episodes = loop.run(backend, prompts, SamplingParams(max_new_tokens=48), 0)
    e = episodes[1]
    call = tok('[calculator(expression="2 + 3")]', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tool = loop.chat.tool_ids([ToolResult("5")])
    answer = tok("#### 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert e.response == call + tool + answer
    n = len(e.response)
    assert batch.response_ids[1, :n].tolist() == e.response
    assert batch.response_mask[1, :n].tolist() == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    assert batch.response_attention_mask[1].tolist() == [1] * n + [0] * (batch.response_ids.shape[1] - n)
    assert torch.all(batch.logprobs[1, len(call) : len(call) + len(tool)] == 0)
    assert torch.all(batch.logprobs[batch.response_mask.bool()] == -0.5)
    # the trainer's layout: attention over prompt + every real response token, positions without gaps
    inputs = batch.training_inputs()
    assert torch.equal(inputs["attention_mask"], torch.cat([batch.prompt_mask, batch.response_attention_mask], 1))
    assert torch.equal(inputs["response_mask"], batch.response_mask)
    # the outcome reward sits on the last POLICY token, not on padding or a tool token
    from verl_core.losses.advantages import outcome_token_rewards

    rewards = outcome_token_rewards(torch.ones(3), batch.response_mask)
    assert rewards[1].nonzero().flatten().tolist() == [n - 1] and rewards.sum() == 3
    # decoding for rewards reads the policy's text only
    from verl_core.rollout.contract import decode_responses

    assert decode_responses(tok, batch)[1] == '[calculator(expression="2 + 3")]#### 5'


def test_gae_carries_values_over_tool_tokens():
    """Tool tokens are not actions: GAE (losses.advantages) skips masked positions, so the value after the
    last policy token of turn 1 is the first policy token of turn 2, as if the tool tokens were not there."""
    from verl_core.losses.advantages import gae_advantages

    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    rewards = torch.tensor([[0.0, 0.0, 5.0, 5.0, 0.0, 1.0]])  # what sits on tool tokens is ignored too
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    policy_only = torch.tensor([[0, 1, 4, 5]])
    ref_adv, ref_ret = gae_advantages(rewards[:, [0, 1, 4, 5]], values[:, [0, 1, 4, 5]], torch.ones(1, 4), gamma=0.9, lam=0.8)
    assert torch.allclose(adv.gather(1, policy_only), ref_adv) and torch.allclose(ret.gather(1, policy_only), ref_ret)
    assert torch.all(adv[0, 2:4] == 0) and torch.all(ret[0, 2:4] == 0)


def test_episodes_stop_at_max_turns_and_at_the_token_budget(tok):
    loop, prompts, backend = _three_episodes(tok)
    loop.max_turns = 2
    _, episodes = loop.run(backend, prompts, SamplingParams(max_new_tokens=48), 0)
    assert [e.truncated for e in episodes] == [None, None, "max_turns"] and not episodes[2].finished
    assert episodes[2].policy_turns == 2 and episodes[2].tool_calls == 1  # the last turn's call is not run
    loop, prompts, backend = _three_episodes(tok)
    loop.max_response_tokens = 12
    batch, episodes = loop.run(backend, prompts, SamplingParams(max_new_tokens=48), 0)
    assert all(len(e.response) <= 12 for e in episodes) and batch.response_ids.shape[1] <= 12
    assert episodes[0].finished and episodes[1].truncated == "max_response_tokens"


def test_multi_turn_batches_keep_their_context_mask_through_select_and_concat(tok):
    loop, prompts, backend = _three_episodes(tok)
    batch, _ = loop.run(backend, prompts, SamplingParams(max_new_tokens=48), 0)
    picked = batch.select_groups([1])
    assert torch.equal(picked.response_attention_mask[0], batch.response_attention_mask[1, : picked.response_ids.shape[1]])
    assert picked.response_ids.shape[1] == int(batch.response_attention_mask[1].sum())
    both = concat_rollouts([batch.select_groups([0]), batch.select_groups([2])], tok.pad_token_id)
    assert both.group_index.tolist() == [0, 1] and torch.equal(both.context_mask.sum(-1), batch.context_mask[[0, 2]].sum(-1))
    assert batch.to("cpu").response_attention_mask is not None


def test_single_turn_batches_are_unchanged():
    b = RolloutBatch(
        prompt_ids=torch.tensor([[0, 5]]),
        prompt_mask=torch.tensor([[0, 1]]),
        response_ids=torch.tensor([[6, 1, 0]]),
        response_mask=torch.tensor([[1, 1, 0]]),
        logprobs=torch.zeros(1, 3),
        group_index=torch.tensor([0]),
        finished=torch.tensor([True]),
    )
    assert b.response_attention_mask is None and torch.equal(b.attention_mask, torch.tensor([[0, 1, 1, 1, 0]]))
    assert concat_rollouts([b, b], 0).response_attention_mask is None and b.select_groups([0]).response_attention_mask is None


def test_episode_seeds_are_a_pure_function_of_the_prompt_seed_and_sample():
    assert episode_seed([7, 8], 1, 0) == episode_seed([8], 0, 0) != episode_seed([8], 0, 1)
    assert episode_seed(3, 0, 0) == episode_seed(3, 0, 0) < 2**40


def test_the_sampler_reports_episode_metrics_and_a_trajectory_table(tok):
    loop, prompts, backend = _three_episodes(tok)
    sampler = EpisodeSampler(backend, loop)
    batch = sampler.generate(prompts, SamplingParams(max_new_tokens=48, n=1), 0)
    assert len(batch) == 3 and sampler.metrics()["agent/tool_calls_per_episode"] == 1.0
    table = trajectory_table(sampler.episodes, [1.0, 1.0, 0.0], tok)
    assert table["turns"] == [1, 2, 3] and table["reward"] == [1.0, 1.0, 0.0]
    assert '"expression": "2 + 3"' in table["tool_calls"][1] and "<|tool|>" in table["transcript"][1]


def test_agent_prompts_carry_the_template_and_ground_truth(tok):
    loop = _loop(tok)
    rows = tokenize_agent_prompts(loop, tasks.eval_rows(2), 256)
    assert (
        tok.decode(rows[0]["prompt_ids"]).startswith("<|user|>\n")
        and rows[0]["ground_truth"] == tasks.eval_rows(1)[0]["ground_truth"]
    )
    plain = tokenize_agent_prompts(loop, [{"prompt": "plain", "ground_truth": 3}], 256)  # a string prompt is a user message
    assert (
        plain[0]["prompt_ids"] == loop.chat.prompt_ids([{"role": "user", "content": "plain"}]) and plain[0]["ground_truth"] == "3"
    )
    assert {p.question for p in tasks.eval_problems()}.isdisjoint(p.question for p in tasks.train_problems(2000))


def test_the_python_tool_runs_programs_in_the_sandbox_and_their_failures_are_tool_errors():
    pytest.importorskip("verl_core.sandbox.runner")
    python = {"python": TOOLS["python"]}
    out = call_tools(
        [
            ToolCall("python", {"code": "print(48 / 2 + 48)"}),
            ToolCall("python", {"code": "raise ValueError('boom')"}),
            ToolCall("python", {"source": "print(1)"}),
        ],
        python,
    )
    assert out[0].ok and out[0].text == "72.0"
    assert not out[1].ok and "boom" in out[1].text
    assert not out[2].ok and "missing required argument 'code'" in out[2].text
