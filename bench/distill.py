"""On-policy distillation vs SFT on the teacher's greedy answers (offline distillation), equal student samples.

    python bench/distill.py                       # default size (~20 min on 2 busy cores)
    python bench/distill.py --quick               # smoke size (~3 min)
    python bench/distill.py --steps 16 --seeds 0 1 --layers 10 --loss jsd

Teacher: ``--teacher``, by default SmolLM2-135M-Instruct (``bundled:smollm2``, 30 layers, fp32); any folder of a
causal LM, e.g. that model after ``configs/smollm2-math.yaml``'s GRPO (a stronger teacher on this task). Student: its first ``--layers``
decoder layers plus its final norm and tied head (``verl_core.modeling.student.student_from_teacher``),
the same tokenizer, warm-started (shared by both methods) by ``--warmup-steps`` SFT steps at ``--warmup-lr`` on
the teacher's greedy answers to other prompts: a truncated model alone emits no words (on its garbage samples
the teacher's next-token distributions teach little), and on-policy distillation is meant to follow SFT
(GKD, Thinking Machines). Task: the bundled arithmetic word problems as one chat user turn (default system
prompt); warm-up, train and held-out prompts disjoint. Per seed, from the same warm student ("student0"):

- ``on-policy``: ``DistillTrainer`` (``--loss``: ``jsd`` = GKD's generalized JSD(0.5) on the student's
  samples, or ``reverse_kl`` = the per-token reverse-KL advantage), one sample per prompt at ``--temperature`` (1 by default);
- ``offline``: ``SFTTrainer`` on the teacher's greedy answers to the same training prompts.

Equal budget: the same ``--steps`` x ``--batch`` student samples (completions trained on; each training
prompt used once by both), the same learning rate, optimizer, batch size and ``--max-new-tokens``.
Wall seconds are reported too (offline: SFT plus generating the teacher's answers, once per seed's share).

Gap metrics on ``--eval-prompts`` held-out prompts (bench/distill_eval.py): exact per-token reverse KL
(student ‖ teacher) on the student's own sampled answers, and exact per-token forward KL (teacher ‖
student) on the teacher's greedy answers (SFT's own target distribution): each method is scored on its
own objective and on the other's. The teacher is at 0 on both, so "gap closed" = (KL(student0) - KL(after))
/ KL(student0). Greedy exact-match accuracy (numeric_match) is reported beside.

Verdict, by ``--rule`` (each set before its runs): ``kl`` (the first rule): PASS when, on every seed, on-policy
closes more of the gap than offline on BOTH KL metrics. ``accuracy`` (set after ``kl`` missed, before any run
under it): the task gap, (acc - acc0) / (teacher acc - acc0) on the held-out prompts; PASS when the teacher is
clearly better (at least ``MIN_TASK_GAP`` above the warm student) and, on every seed, on-policy closes more of it
than offline. ``paired`` (set after ``accuracy`` passed by one problem in 200 per seed, before any run under it):
the same task gap; on every seed on-policy more accurate than offline; and, pooled over the seeds, the held-out
problems on-policy gets right and offline wrong outnumber the reverse by a one-sided exact sign test (McNemar's
exact test) at p < ``MAX_SIGN_TEST_P``, so that a win by noise does not pass. Exit 0 PASS, 1 a miss, 2 a crash.
Results: bench/results/distill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.distill_eval import HELD_OUT_SEED  # noqa: E402
from verl_core.train.callbacks import Callback  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "distill.json"
METRICS = ("reverse_kl", "forward_kl")
MIN_TASK_GAP = 0.10
MAX_SIGN_TEST_P = 0.05
RULES = {
    "kl": "on every seed, on-policy closes more of both KL gaps than offline",
    "accuracy": f"the teacher >= {MIN_TASK_GAP:.2f} above the warm student, and on every seed on-policy closes more of that "
    "accuracy gap",
    "paired": f"the teacher >= {MIN_TASK_GAP:.2f} above the warm student; on every seed on-policy more accurate than "
    f"offline on the held-out problems; and, pooled over the seeds, on-policy right where offline is wrong more "
    f"often than the reverse, one-sided exact sign test p < {MAX_SIGN_TEST_P}",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (rollout steps on-policy)")
    p.add_argument("--batch", type=int, default=8, help="student samples per step")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--teacher",
        default="bundled:smollm2",
        help="the teacher: a model folder, a .gguf file or bundled:smollm2 (the student is cut from it)",
    )
    p.add_argument("--layers", type=int, default=10, help="student decoder layers (the teacher has 30)")
    p.add_argument("--loss", choices=("jsd", "reverse_kl"), default="jsd", help="the on-policy loss")
    p.add_argument("--jsd-beta", type=float, default=0.5, help="jsd: GKD's beta (0 forward KL, 1 reverse KL)")
    p.add_argument("--teacher-fraction", type=float, default=0.0, help="on-policy: teacher_forced_fraction (1 - GKD's lambda)")
    p.add_argument("--methods", nargs="+", choices=("on-policy", "offline"), default=["on-policy", "offline"])
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of both methods")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="on-policy: the student's sampling temperature (GKD's gamma)")
    p.add_argument(
        "--eval-split-seed", type=int, default=HELD_OUT_SEED, help="seed of the held-out problems (another one for pilots)"
    )
    p.add_argument("--warmup-steps", type=int, default=16, help="shared SFT warm start of the student (0: none)")
    p.add_argument("--warmup-lr", type=float, default=3e-4)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument(
        "--curve-every", type=int, default=0, help="also score held-out greedy accuracy every N steps (0: at the end only)"
    )
    p.add_argument("--threads", default="auto", help="torch threads: auto (1 on a busy machine) or a number")
    p.add_argument("--rule", choices=tuple(RULES), default="kl", help="the verdict (see the module's docstring)")
    p.add_argument("--quick", action="store_true", help="smoke size: 2 steps of 4, 1 seed, 8 held-out prompts")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seeds, args.eval_prompts, args.max_new_tokens = 2, 4, args.seeds[:1], 8, 16
        args.warmup_steps = min(args.warmup_steps, 2)
    return args


class AccuracyCurve(Callback):
    """A training callback: held-out greedy accuracy every ``every`` loop steps before the last, with the
    seconds it took (taken out of the method's wall time)."""

    def __init__(self, held, model_of, every: int, last: int):
        self.held, self.model_of, self.every, self.last = held, model_of, every, last
        self.points: list[dict] = []
        self.seconds = 0.0

    def on_step_end(self, step: int) -> None:
        if self.every and step % self.every == 0 and step < self.last:
            t0 = time.perf_counter()
            correct = self.held.greedy_correct(self.model_of())
            self.seconds += time.perf_counter() - t0
            self.points.append({"step": step, "accuracy": sum(correct) / len(correct)})
            print(f"  step {step}: held-out greedy accuracy {self.points[-1]['accuracy']:.3f}", flush=True)


def shared_settings(args, seed: int, out: Path, steps=None, lr=None) -> dict:
    """What both sides train with, so that they differ only in where their samples come from."""
    return dict(
        batch_size=args.batch,
        max_steps=steps or args.steps,
        learning_rate=lr or args.lr,
        mixed_precision="no",
        seed=seed,
        progress=False,
        logging_steps=1,
        output_dir=str(out),
    )


def train_on_policy(student_dir: Path, teacher, prompts: list[dict], args, seed: int, out: Path, curve=None):
    from verl_core.algorithms.distill import DistillTrainer
    from verl_core.policies import LLMPolicy

    trainer = DistillTrainer(
        policy=LLMPolicy.from_pretrained(str(student_dir)),
        teacher=teacher,
        prompts=prompts,
        loss=args.loss,
        jsd_beta=args.jsd_beta,
        teacher_forced_fraction=args.teacher_fraction,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        callbacks=[curve] if curve else [],
        **shared_settings(args, seed, out),
    )
    if curve:
        curve.model_of = lambda: trainer.policy.model
    result = trainer.train()
    return trainer.policy.model, {k: [round(v, 4) for _, v in h] for k, h in result.history.items() if k.startswith("distill/")}


def train_offline(student_dir: Path, rows: list[dict], args, seed: int, out: Path, steps=None, lr=None, curve=None):
    from verl_core.algorithms.sft import SFTTrainer

    trainer = SFTTrainer(
        str(student_dir),
        train_dataset=rows,
        callbacks=[curve] if curve else [],
        **shared_settings(args, seed, out, steps, lr),
    )
    if curve:
        curve.model_of = lambda: trainer.model
    result = trainer.train()
    return trainer.model, {"loss": [round(v, 4) for _, v in result.history.get("loss", [])]}


def _shown(scores: dict) -> dict:
    """A student's scores for the progress log: without the per-problem ``correct`` list."""
    return {k: v for k, v in scores.items() if k != "correct"}


def run(args) -> dict:
    import torch

    from bench.distill_eval import HeldOut, chat_prompt, gap_closed, generate, response_texts, task_splits
    from bench.threads import resolve_threads
    from verl_core.modeling.student import student_from_teacher
    from verl_core.policies import LLMPolicy

    threads = resolve_threads(args.threads, "cpu")
    if threads:
        torch.set_num_threads(threads)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="distill-bench-"))
    teacher = LLMPolicy.from_pretrained(args.teacher)
    tok = teacher.tokenizer
    student_dir = student_from_teacher(teacher.model, args.layers, work / "student0", tokenizer=tok)
    n_train = args.steps * args.batch
    n_warm = args.warmup_steps * args.batch
    train, held_out = task_splits(n_train + n_warm, args.eval_prompts, args.eval_split_seed)
    train, warm = train[:n_train], train[n_train:]
    prompts = [{"prompt": chat_prompt(tok, p.question), "ground_truth": str(p.answer)} for p in train]
    ids = [tok(r["prompt"])["input_ids"] for r in prompts]
    assert ids[0] == tok.apply_chat_template(
        [{"role": "user", "content": train[0].question}], add_generation_prompt=True, return_dict=False
    )

    t0 = time.perf_counter()
    held = HeldOut(teacher.model, tok, held_out, args.max_new_tokens)
    t_teacher_eval = time.perf_counter() - t0
    print(f"teacher held-out greedy accuracy {held.teacher_accuracy:.3f} ({t_teacher_eval:.0f}s)", flush=True)
    t0 = time.perf_counter()
    offline = "offline" in args.methods
    teacher_answers = response_texts(tok, generate(teacher.model, tok, ids, args.max_new_tokens, 0.0)) if offline else []
    t_teacher_answers = time.perf_counter() - t0
    sft_rows = [{"prompt": r["prompt"], "completion": a} for r, a in zip(prompts, teacher_answers)]
    print(f"teacher greedy answers for {len(ids)} training prompts: {t_teacher_answers:.0f}s", flush=True)

    t_warm = 0.0
    if n_warm:  # the shared warm start: SFT of the truncated student on the teacher's answers to other prompts
        t0 = time.perf_counter()
        warm_ids = [tok(chat_prompt(tok, p.question))["input_ids"] for p in warm]
        warm_answers = response_texts(tok, generate(teacher.model, tok, warm_ids, args.max_new_tokens, 0.0))
        warm_rows = [{"prompt": tok.decode(i), "completion": a} for i, a in zip(warm_ids, warm_answers)]
        model, _ = train_offline(student_dir, warm_rows, args, 0, work / "warmup", args.warmup_steps, args.warmup_lr)
        del model
        student_dir = work / "warmup" / "model"
        t_warm = time.perf_counter() - t0
        print(f"warm start: {args.warmup_steps} SFT steps on {n_warm} teacher answers ({t_warm:.0f}s)", flush=True)
    base_model = LLMPolicy.from_pretrained(str(student_dir)).model
    base = held.score(base_model)
    del base_model
    print(f"student0: {_shown(base)}", flush=True)

    runs = []
    for seed in args.seeds:
        for method in args.methods:
            t0 = time.perf_counter()
            out = work / f"{method}-{seed}"
            curve = AccuracyCurve(held, None, args.curve_every, args.steps) if args.curve_every else None
            if method == "on-policy":
                model, history = train_on_policy(student_dir, teacher, prompts, args, seed, out, curve)
            else:
                model, history = train_offline(student_dir, sft_rows, args, seed, out, curve=curve)
            train_s = time.perf_counter() - t0 - (curve.seconds if curve else 0.0)
            wall = train_s + (t_teacher_answers if method == "offline" else 0.0)
            after = held.score(model)
            row = {
                "method": method,
                "seed": seed,
                "samples": n_train,
                "train_s": round(train_s, 1),
                "wall_s": round(wall, 1),
                "after": after,
                "closed": {
                    **{m: gap_closed(base[m], after[m]) for m in METRICS},
                    "accuracy": gap_closed(base["accuracy"], after["accuracy"], held.teacher_accuracy),
                },
                "history": history,
                "curve": [
                    {"step": 0, "accuracy": base["accuracy"]},
                    *(curve.points if curve else []),
                    {"step": args.steps, "accuracy": after["accuracy"]},
                ],
            }
            runs.append(row)
            print(f"{method} seed {seed}: {_shown(after)} closed {row['closed']} ({wall:.0f}s)", flush=True)
            del model
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "threads": threads,
        "teacher": args.teacher,
        "teacher_accuracy": held.teacher_accuracy,
        "teacher_answers_s": round(t_teacher_answers, 1),
        "warmup_s": round(t_warm, 1),
        "student0": base,
        "runs": runs,
        "total_s": round(time.perf_counter() - t_start, 1),
    }


def verdict(res: dict) -> tuple[bool, list[str]]:
    lines, ok = [], True
    by = {(r["method"], r["seed"]): r for r in res["runs"]}
    rule = res["config"]["rule"]
    metrics = METRICS if rule == "kl" else ("accuracy",)
    if rule in ("accuracy", "paired"):
        gap = res["teacher_accuracy"] - res["student0"]["accuracy"]
        ok = gap >= MIN_TASK_GAP
        lines.append(
            f"task gap: teacher {res['teacher_accuracy']:.3f} - student0 {res['student0']['accuracy']:.3f} = {gap:+.3f}"
            f" ({'clear' if ok else 'MISS: not clearly better'}, needs >= {MIN_TASK_GAP})"
        )
    for seed in res["config"]["seeds"]:
        if ("offline", seed) not in by or ("on-policy", seed) not in by:
            return False, [f"seed {seed}: both methods are needed for a verdict"]
        on, off = by[("on-policy", seed)], by[("offline", seed)]
        for m in metrics:
            win = on["closed"][m] > off["closed"][m]
            ok &= win
            lines.append(
                f"seed {seed} {m}: on-policy {on['closed'][m]:+.3f} vs offline {off['closed'][m]:+.3f} -> {'win' if win else 'MISS'}"
            )
    if rule == "paired":
        wins, losses, p = paired_counts(res)
        ok &= p < MAX_SIGN_TEST_P
        lines.append(
            f"paired over {len(res['config']['seeds'])} seeds: on-policy right & offline wrong {wins}, offline right & "
            f"on-policy wrong {losses}; one-sided sign test p = {p:.4f} -> "
            f"{'win' if p < MAX_SIGN_TEST_P else 'MISS'} (needs < {MAX_SIGN_TEST_P})"
        )
    return ok, lines


def paired_counts(res: dict) -> tuple[int, int, float]:
    """Discordant held-out problems pooled over seeds: (on-policy right & offline wrong, the reverse, sign-test p)."""
    from bench.distill_eval import sign_test_p

    by = {(r["method"], r["seed"]): r["after"]["correct"] for r in res["runs"]}
    wins = losses = 0
    for seed in res["config"]["seeds"]:
        for on, off in zip(by[("on-policy", seed)], by[("offline", seed)]):
            wins += on > off
            losses += off > on
    return wins, losses, sign_test_p(wins, losses)


def table(res: dict) -> str:
    c, b = res["config"], res["student0"]
    head = (
        f"On-policy distillation ({c['loss']}) vs SFT on teacher greedy answers; teacher {c['teacher']}, "
        f"student = its first {c['layers']} layers + {c['warmup_steps']} shared SFT warm-up steps (lr {c['warmup_lr']}); "
        f"arithmetic chat prompts; {c['steps']} steps x {c['batch']} samples "
        f"= {c['steps'] * c['batch']} student samples per run (equal samples), lr {c['lr']}, on-policy sampling temperature "
        f"{c['temperature']}, max_new_tokens "
        f"{c['max_new_tokens']}, {c['eval_prompts']} held-out prompts (split seed {c['eval_split_seed']}), {res['threads'] or 'default'} torch thread(s)\n"
        "rev KL = exact KL(student||teacher)/token on the student's samples; fwd KL = exact KL(teacher||student)/token "
        "on the teacher's greedy answers; teacher = 0 on both; closed = (KL0 - KL) / KL0; acc = greedy numeric match\n"
    )
    rows = [
        "| method | seed | rev KL | closed | fwd KL | closed | acc | closed | samples | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| teacher | - | 0 | - | 0 | - | {res['teacher_accuracy']:.3f} | - | - | - |",
        f"| student0 | - | {b['reverse_kl']:.3f} | 0 | {b['forward_kl']:.3f} | 0 | {b['accuracy']:.3f} | 0 | 0 | - |",
    ]
    for r in res["runs"]:
        a, cl = r["after"], r["closed"]
        rows.append(
            f"| {r['method']} | {r['seed']} | {a['reverse_kl']:.3f} | {cl['reverse_kl']:+.3f} | {a['forward_kl']:.3f} "
            f"| {cl['forward_kl']:+.3f} | {a['accuracy']:.3f} | {cl['accuracy']:+.3f} | {r['samples']} | {r['wall_s']:.0f} |"
        )
    for method in ("on-policy", "offline"):
        rs = [r for r in res["runs"] if r["method"] == method]
        if rs:
            mean = {m: statistics.mean(r["closed"][m] for r in rs) for m in (*METRICS, "accuracy")}
            rows.append(
                f"| {method} mean | - | - | {mean['reverse_kl']:+.3f} | - | {mean['forward_kl']:+.3f} | - "
                f"| {mean['accuracy']:+.3f} | - | - |"
            )
    notes = f"offline wall s includes the teacher's greedy answers ({res['teacher_answers_s']:.0f}s); total {res['total_s']:.0f}s"
    return head + "\n".join(rows) + "\n" + notes


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except Exception:
        traceback.print_exc()
        return 2
    ok, lines = verdict(res)
    res["verdict"] = {"pass": ok, "rule": RULES[args.rule], "lines": lines}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(table(res))
    print("\n".join(lines))
    print(f"VERDICT: {'PASS' if ok else 'MISS'} (rule {args.rule}: {RULES[args.rule]})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
