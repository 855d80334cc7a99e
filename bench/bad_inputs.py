"""Bad inputs through the CLI and the Python API, as a new user or an attacker gives them.

Each case must fail with the project's error in one readable line that names what is wrong (the key,
the file, the row), before any stage trains, without a traceback, and without being retried. The
table classifies each outcome: ``clear`` (the expected words, no traceback), ``unclear`` (an error
that misses them), ``traceback``, or ``accepted`` (no error at all), with the seconds to fail. CLI
cases run ``python -m flows.cli run`` in a fresh process each; API cases run in one process.

    python bench/bad_inputs.py            # prints the table; exits 1 when a case is not clear
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def files(tmp: Path) -> dict[str, Path]:
    def jsonl(name, rows):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp / name

    good = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(32)]
    out = {
        "no_completion": jsonl("no_completion.jsonl", good[:5] + [{"prompt": "x"}]),
        "int_prompt": jsonl("int_prompt.jsonl", good[:3] + [{"prompt": 7, "completion": "x"}]),
        "no_truth": jsonl("no_truth.jsonl", [{"prompt": "1+1="}] * 4),
        "no_rejected": jsonl("no_rejected.jsonl", [{"prompt": "p", "chosen": "a"}] * 4),
        "good_sft": jsonl("good_sft.jsonl", good),
    }
    (tmp / "bad_json.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n')
    (tmp / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "completion": "b"}\n'.encode("latin-1"))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "notes.txt").write_text("hello")
    (tmp / "afile").write_text("x")
    (tmp / "bad.yaml").write_text("sft: [unclosed\n")
    (tmp / "nocfg").mkdir()
    (tmp / "evil.pkl").write_bytes(b"\x80\x04K\x01.")
    for name in ("bad_json.jsonl", "latin1.jsonl", "empty.jsonl", "notes.txt", "afile", "bad.yaml", "nocfg", "evil.pkl"):
        out[name] = tmp / name
    return out


def cli_cases(f: dict[str, Path]) -> list[tuple[str, list[str], str]]:
    """(name, CLI arguments after ``run``, words the error must hold)."""
    s = lambda *kv: [a for x in kv for a in ("--set", x)]  # noqa: E731
    return [
        ("unknown key", s("sft.nope=1"), "unknown key 'sft.nope'"),
        ("wrong type", s("sft.learning_rate=abc"), "sft.learning_rate"),
        ("negative steps", s("sft.max_steps=-1"), "sft.max_steps"),
        ("NaN learning rate", s("sft.learning_rate=.nan"), "sft.learning_rate"),
        ("unknown algorithm", s("policy_optimisation.algorithm=dpoo"), "policy_optimisation.algorithm"),
        ("unknown evaluation reward", s("evaluation.reward=exact_matchh"), "evaluation.reward: unknown rule reward"),
        ("unknown reward rule", s("policy_optimisation.grpo.reward_rules={nope: 1.0}"), "reward_rules: unknown rule reward"),
        ("unknown eval_reward", s("policy_optimisation.ppo.eval_reward=zz"), "eval_reward: unknown rule reward"),
        ("missing evaluation file", s("evaluation.data.path=/nonexistent/e.jsonl"), "/nonexistent/e.jsonl"),
        ("missing SFT file", s("sft.data.path=/nonexistent/s.jsonl"), "/nonexistent/s.jsonl"),
        ("row without completion", s(f"sft.data.path={f['no_completion']}"), "row 5 (line 6): missing field 'completion'"),
        ("malformed JSON line", s(f"sft.data.path={f['bad_json.jsonl']}"), "line 2: not valid JSON"),
        ("not UTF-8", s(f"sft.data.path={f['latin1.jsonl']}"), "not valid UTF-8"),
        ("empty file", s(f"sft.data.path={f['empty.jsonl']}"), "empty"),
        ("unknown file type", s(f"sft.data.path={f['notes.txt']}"), "unknown file type"),
        ("field of the wrong type", s(f"sft.data.path={f['int_prompt']}"), "'prompt'"),
        (
            "prompts without ground_truth",
            s("policy_optimisation.algorithm=grpo", f"policy_optimisation.prompts.path={f['no_truth']}"),
            "missing field 'ground_truth'",
        ),  # noqa: E501
        ("missing pairs file", s("preference_data.path=/nonexistent/p.jsonl"), "/nonexistent/p.jsonl"),
        ("pairs without rejected", s(f"preference_data.path={f['no_rejected']}"), "missing field 'rejected'"),
        ("missing SFT model", s("sft.model_path=/nonexistent/model"), "sft.model_path: model path does not exist"),
        ("missing base model", s("base_model=/nonexistent/base"), "base_model: model path does not exist"),
        ("model folder without config", s(f"base_model={f['nocfg']}"), "has no config.json"),
        ("workdir is a file", s(f"workdir={f['afile']}"), "is a file"),
        ("tracking unreachable", s("tracking.uri=http://127.0.0.1:9"), "cannot be reached"),
        ("unknown environment", s("policy_optimisation.grpo.environment=nope"), "unknown environment 'nope'"),
        (
            "unknown tool",
            s("policy_optimisation.grpo.environment=calculator", "policy_optimisation.grpo.tools=[rm_rf]"),
            "unknown tool",
        ),  # noqa: E501
        ("unknown rollout backend", s("policy_optimisation.grpo.rollout.backend=sglang"), "rollout.backend"),
        ("vLLM option outside its section", s("policy_optimisation.grpo.rollout.enforce_eager=true"), "unknown key"),
        ("unknown launcher", s("launcher.kind=slurm"), "launcher.kind"),
        ("zero evaluation rows", s("evaluation.num_rows=0"), "evaluation.num_rows"),
        ("column mapped to nothing", s(f"sft.data.path={f['good_sft']}", "sft.data.columns={prompt: question}"), "question"),
        ("invalid YAML config", ["--config", str(f["bad.yaml"])], "bad.yaml"),
        ("missing config file", ["--config", "/nonexistent/c.yaml"], "/nonexistent/c.yaml"),
    ]


API_CASES = [
    ("SFT from a missing model", "SFTTrainer('/nonexistent/m', train_dataset=rows(32))", "model path does not exist"),
    (
        "SFT row without completion",
        "SFTTrainer(tiny, train_dataset=rows(31) + [{'prompt': 'x'}])",
        "row 31: missing field 'completion'",
    ),
    (
        "DPO pair without rejected",
        "DPOTrainer(tiny, train_dataset=[{'prompt': 'p', 'chosen': 'a'}] * 16)",
        "missing field 'rejected'",
    ),
    (
        "KTO label not a bool",
        "KTOTrainer(tiny, train_dataset=[{'prompt': 'p', 'completion': 'a', 'label': 'yes'}] * 16)",
        "label",
    ),
    ("unknown eval_reward", "GRPOConfig(eval_reward='zz')", "unknown rule reward 'zz'"),
    ("unknown rule", "RewardSource(rules={'nope': 1.0})", "unknown rule reward 'nope'"),
    ("output_dir is a file", "SFTConfig(output_dir=str(tmp / 'afile'))", "is a file, not a folder"),
    ("one row, batch 16", "SFTTrainer(tiny, train_dataset=rows(1), batch_size=16)", "1 rows, fewer than batch_size 16"),
    ("a pickle as data", "load_rows(str(tmp / 'evil.pkl'))", "unknown file type"),
    ("unknown config key", "SFTConfig(lerning_rate=1e-4)", "lerning_rate"),
    ("unknown DPO loss", "DPOConfig(loss_type='sigmoidd')", "loss_type"),
    ("model folder without config", "load_causal_lm(str(tmp / 'nocfg'))", "has no config.json"),
    ("empty dataset", "SFTTrainer(tiny, train_dataset=[])", "empty"),
]

API_PROGRAM = r"""
import json, sys, time, traceback
from pathlib import Path
from verl_core import DPOConfig, GRPOConfig, KTOTrainer, DPOTrainer, SFTConfig, SFTTrainer, tiny_model_path
from verl_core.data import load_rows
from verl_core.errors import UserError
from verl_core.modeling.loading import load_causal_lm
from verl_core.rewards import RewardSource
tmp, tiny = Path(sys.argv[1]), str(tiny_model_path())
rows = lambda n: [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(n)]
out = []
for name, code, words in json.loads(sys.argv[2]):
    start = time.monotonic()
    try:
        eval(code)
        out.append((name, "accepted", "", time.monotonic() - start))
    except UserError as err:
        out.append((name, "clear" if words in str(err) else "unclear", f"{type(err).__name__}: {err}", time.monotonic() - start))
    except Exception as err:
        out.append((name, "traceback", f"{type(err).__name__}: {err} | {traceback.format_exc(limit=2)}", time.monotonic() - start))
print("RESULT " + json.dumps(out))
"""


def run_cli(args: list[str], workdir: Path, words: str) -> tuple[str, str, float]:
    if "--config" not in args:
        args = [*args, "--set", f"workdir={workdir}"] if not any(a.startswith("workdir=") for a in args) else args
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(workdir.parent / "prefect")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900
    )
    took = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("verl-core: ")]
    if proc.returncode == 0:
        return "accepted", "", took
    if "Traceback" in proc.stderr:
        return "traceback", proc.stderr[-300:], took
    if len(errors) == 1 and words in proc.stderr:
        return "clear", errors[0], took
    return "unclear", (errors[0] if errors else proc.stderr[-300:]), took


def main() -> int:
    rows: list[tuple[str, str, str, str, float]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f = files(tmp)
        for i, (name, args, words) in enumerate(cli_cases(f)):
            outcome, line, took = run_cli(args, tmp / f"w{i}", words)
            rows.append(("CLI", name, outcome, line, took))
            print(f"CLI  {outcome:9s} {took:5.1f}s  {name}: {line[:160]}", flush=True)
        program = [sys.executable, "-c", API_PROGRAM, str(tmp), json.dumps(API_CASES)]
        proc = subprocess.run(
            program, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        result = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            print(proc.stderr[-3000:])
            return 2
        for name, outcome, line, took in json.loads(result.removeprefix("RESULT ")):
            rows.append(("API", name, outcome, line, took))
            print(f"API  {outcome:9s} {took:5.1f}s  {name}: {line[:160]}", flush=True)
    counts = {k: sum(r[2] == k for r in rows) for k in ("clear", "unclear", "traceback", "accepted")}
    print("\n| via | case | outcome | seconds to fail | message |\n|---|---|---|---|---|")
    for via, name, outcome, line, took in rows:
        print(f"| {via} | {name} | {outcome} | {took:.1f} | {line[:140].replace('|', '/')} |")
    print(f"\n{len(rows)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    cli_times = sorted(r[4] for r in rows if r[0] == "CLI")
    print(f"CLI time to fail: median {cli_times[len(cli_times) // 2]:.1f} s, max {cli_times[-1]:.1f} s (a fresh process each)")
    return 0 if counts["clear"] == len(rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)
