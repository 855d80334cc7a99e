#!/usr/bin/env bash
# Reproduces docs/screenshots/*.png: the real Prefect and MLflow servers (`verl-core servers`), a process work
# pool, the deployment of deployments/prefect.yaml, a worker, four deployed runs, and headless Chromium
# screenshots of both UIs (docs/screenshots/README.md says what each shows).
#
#   bench/screenshots.sh      # from the repository root; about 18 minutes on a 2-core CPU (OUT=, WD= override)
#
# Needs: the project's .venv, Debian's chromium (`apt-get install -y chromium`), ports 4200 and 5000 free.
# Playwright goes into a separate venv ($SHOTS_VENV, default /tmp/shots-venv), never into .venv; it drives
# /usr/bin/chromium (no browser download). Everything runs in $WD (default: a fresh temporary folder): the
# MLflow store, the Prefect database ($PREFECT_HOME), stage outputs. Servers and worker are stopped on exit.
#
# The runs (tiny step counts):
#   A  rlhf-default deployment as deployed: PPO pipeline, SFT 120 steps, PPO 10 steps
#   B  configs/agent.yaml (calculator tool), SFT 200 steps, GRPO 3 steps, with PREFECT_LOGGING_EXTRA_LOGGERS=verl_core
#      added to the job's environment (without it a deployed run's log has no progress lines: docs/screenshots/README.md)
#   C  evaluation_data=/nonexistent/e.jsonl (fails in preflight)
#   D  policy_optimisation.ppo.gradient_accumulation_steps=3 (fails when PPO starts; the earlier stages are A's,
#      from the cache, unless the code changed in between)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/docs/screenshots}
WD=${WD:-$(mktemp -d /tmp/verl-core-shots.XXXXXX)}
SHOTS_VENV=${SHOTS_VENV:-/tmp/shots-venv}
VENV=$ROOT/.venv
mkdir -p "$OUT" "$WD/prefect-home"
cd "$ROOT"

export PREFECT_HOME=$WD/prefect-home
export PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_UI_API_URL=http://127.0.0.1:4200/api
export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
export PYTHONUNBUFFERED=1
export PATH=$VENV/bin:$PATH
T0=$(date +%s)
step() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

PGIDS=()
cleanup() {
    for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    sleep 5
    for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done   # the worker ignores SIGTERM
}
trap cleanup EXIT

# -- tools -----------------------------------------------------------------------------------------------
command -v chromium >/dev/null || { echo "install chromium first: apt-get install -y chromium"; exit 1; }
if ! "$SHOTS_VENV/bin/python" -c "import playwright" 2>/dev/null; then
    step "playwright into $SHOTS_VENV"
    python3 -m venv "$SHOTS_VENV" && "$SHOTS_VENV/bin/pip" install -q playwright
fi
cat > "$WD/shot.py" <<'EOF'
"""shot.py OUT URL [options]: open URL in headless /usr/bin/chromium, act, screenshot the viewport."""
import argparse, time
from playwright.sync_api import sync_playwright
ap = argparse.ArgumentParser()
ap.add_argument("out"); ap.add_argument("url")
ap.add_argument("--wait", action="append", default=[], help="text to wait for")
ap.add_argument("--click", action="append", default=[], help="text to click")
ap.add_argument("--click-button", action="append", default=[], help="first button with this exact name")
ap.add_argument("--click-css-all", action="append", default=[], help="click every element matching")
ap.add_argument("--mlflow-columns", default="", help="columns to add to an MLflow runs table, comma-separated")
ap.add_argument("--fill", action="append", default=[], help="PLACEHOLDER=TEXT")
ap.add_argument("--trace", default="", help="MLflow Traces tab: search this, open the first trace")
ap.add_argument("--trace-span", default="", help="then select this span")
ap.add_argument("--size", default="1600x1000")
ap.add_argument("--settle", type=float, default=3.0)
a = ap.parse_args()
w, h = map(int, a.size.split("x"))
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
    page = b.new_page(viewport={"width": w, "height": h})
    page.goto(a.url, wait_until="networkidle", timeout=90000)
    for t in a.wait:
        try:
            page.get_by_text(t, exact=False).first.wait_for(timeout=60000)
        except Exception:
            print(f"WARNING: {t!r} never appeared on {a.url}")
    time.sleep(1.5)
    for sel in ["text=Got it", "[data-component-id='mlflow.assistant.chat_panel.close']"]:  # MLflow's pop-ups
        if page.locator(sel).count():
            try:
                page.locator(sel).first.click(timeout=3000, force=True); time.sleep(0.7)
            except Exception:
                pass
    for c in a.click:
        page.get_by_text(c, exact=False).first.click(timeout=60000); time.sleep(1.5)
    for c in a.click_button:
        page.get_by_role("button", name=c, exact=True).first.click(timeout=60000); time.sleep(1)
    if a.mlflow_columns:
        page.get_by_role("button", name="Columns").first.click(); time.sleep(1.5)
        for col in a.mlflow_columns.split(","):
            page.get_by_placeholder("Search columns").fill(col); time.sleep(1)
            page.get_by_text(col, exact=True).last.click(); time.sleep(0.7)
        page.keyboard.press("Escape"); time.sleep(1)
    for f in a.fill:
        ph, text = f.split("=", 1)
        page.get_by_placeholder(ph).first.fill(text); time.sleep(2)
    for c in a.click_css_all:
        for i in range(page.locator(c).count()):
            page.locator(c).nth(i).click(timeout=30000); time.sleep(1)
    if a.trace:
        box = page.get_by_placeholder("Search traces by id, input, or output")
        box.fill(a.trace); page.keyboard.press("Enter"); time.sleep(4)
        page.locator("[role=row]").nth(1).locator("[role=cell]").nth(2).click(); time.sleep(5)
        if a.trace_span:
            page.get_by_text(a.trace_span, exact=True).first.click(timeout=10000); time.sleep(3)
    time.sleep(a.settle)
    page.screenshot(path=a.out)
    b.close()
print(a.out)
EOF
shot() { "$SHOTS_VENV/bin/python" "$WD/shot.py" "$@"; }

# -- Prefect API helpers -----------------------------------------------------------------------------------
state() { curl -s "$PREFECT_API_URL/flow_runs/$1" | python3 -c "import json,sys; print(json.load(sys.stdin)['state_type'])"; }
wait_final() {  # flow-run id, timeout seconds
    local end=$(( $(date +%s) + $2 ))
    while (( $(date +%s) < end )); do
        case $(state "$1") in COMPLETED|FAILED|CRASHED|CANCELLED) return 0;; esac
        sleep 5
    done
    echo "flow run $1 did not finish within $2 s"; return 1
}
api_log_count() {  # flow-run id, text: how many of the run's log lines in the Prefect API contain it
    curl -s -X POST "$PREFECT_API_URL/logs/filter" -H 'content-type: application/json' \
        -d "{\"logs\": {\"flow_run_id\": {\"any_\": [\"$1\"]}}, \"limit\": 200}" \
        | python3 -c "import json,sys; print(sum('$2' in l['message'] for l in json.load(sys.stdin)))"
}
wait_for() {  # flow-run id, shell condition: until the condition holds (fails if the run ends first)
    until eval "$2"; do
        case $(state "$1") in COMPLETED|FAILED|CRASHED|CANCELLED) echo "flow run $1 ended before: $2"; return 1;; esac
        sleep 5
    done
}
deploy_run() {  # flow-run name, params JSON, [job-variable env JSON]: prints the flow-run id
    local extra=()
    [[ -n ${3:-} ]] && extra=(--job-variable "env=$3")
    prefect deployment run rlhf-pipeline/rlhf-default --flow-run-name "$1" --params "$2" "${extra[@]}" \
        | awk '/UUID:/ {print $NF}'
}

# -- 1. servers, pool, deployment, worker ------------------------------------------------------------------
step "servers (workdir $WD)"
setsid "$VENV/bin/python" -m flows.cli servers --workdir "$WD" > "$WD/servers.log" 2>&1 < /dev/null &
PGIDS+=($!)
for _ in $(seq 300); do
    curl -sf http://127.0.0.1:4200/api/health >/dev/null && curl -sf http://127.0.0.1:5000/health >/dev/null && break
    sleep 2
done
step "work pool, deployment, worker"
prefect work-pool create verl-core-process --type process >/dev/null
prefect --no-prompt deploy --prefect-file deployments/prefect.yaml --name rlhf-default > "$WD/deploy.log"
DEPLOYMENT=$(grep -o 'deployments/deployment/[0-9a-f-]*' "$WD/deploy.log" | head -1 | cut -d/ -f3)
setsid prefect worker start --pool verl-core-process > "$WD/worker.log" 2>&1 < /dev/null &
PGIDS+=($!)

# -- 2. run A: the deployment as deployed ------------------------------------------------------------------
step "run A (PPO pipeline)"
A=$(deploy_run rlhf-ppo '{"algorithm": "ppo", "sft_max_steps": 120, "policy_max_steps": 10, "workdir": "'"$WD"'",
    "overrides": "reward_model.max_steps=10; evaluation.num_rows=50"}')
wait_for "$A" 'grep -q "PPOTrainer: .*/10 steps" "$WD/worker.log"'
step "run A is training PPO: its Prefect log (the progress lines are only in the worker's terminal)"
shot "$OUT/04b-prefect-deployed-run-log-no-progress.png" "http://127.0.0.1:4200/runs/flow-run/$A" \
    --wait "Beginning flow run" --size 1600x1300
wait_final "$A" 3600

# -- 3. run B: the agent recipe, with the project's loggers sent to the Prefect API -----------------------
step "run B (agent recipe)"
B=$(deploy_run agent-calculator '{"config_file": "configs/agent.yaml", "sft_max_steps": 200, "policy_max_steps": 3,
    "workdir": "'"$WD"'", "overrides": "policy_optimisation.grpo.batch_size=16; policy_optimisation.grpo.mini_batch_size=16; evaluation.num_rows=16"}' \
    '{"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false", "PREFECT_LOGGING_EXTRA_LOGGERS": "verl_core"}')
wait_for "$B" '(( $(api_log_count "$B" "SFTTrainer: ") >= 5 ))'
step "run B mid-SFT: its Prefect log"
shot "$OUT/04-prefect-run-log-mid-training.png" "http://127.0.0.1:4200/runs/flow-run/$B" \
    --wait "steps (" --size 1600x1400
wait_final "$B" 3600

# -- 4. runs C and D: failures -----------------------------------------------------------------------------
step "runs C and D (failures)"
C=$(deploy_run bad-eval-data '{"evaluation_data": "/nonexistent/e.jsonl", "workdir": "'"$WD"'"}')
D=$(deploy_run bad-grad-accum '{"algorithm": "ppo", "sft_max_steps": 120, "policy_max_steps": 10, "workdir": "'"$WD"'",
    "overrides": "reward_model.max_steps=10; evaluation.num_rows=50; policy_optimisation.ppo.gradient_accumulation_steps=3"}')
wait_final "$C" 900
wait_final "$D" 1800
sleep 5

# -- 5. the remaining screenshots --------------------------------------------------------------------------
step "screenshots"
read -r EXP PPO_RUN FAILED_RUN TRACE < <("$VENV/bin/python" - <<'EOF' 2>/dev/null
import mlflow
c = mlflow.MlflowClient()
exp = c.get_experiment_by_name("verl-core").experiment_id
ppo = c.search_runs([exp], "attributes.run_name = 'policy_optimisation-ppo' and attributes.status = 'FINISHED'")[0].info.run_id
failed = c.search_runs([exp], "attributes.run_name = 'policy_optimisation-ppo' and attributes.status = 'FAILED'")[0].info.run_id
trace = next(t.info.trace_id for t in c.search_traces(locations=[exp], max_results=500)
             if t.info.tags.get("verl_core.kind") == "evaluation final" and any(s.span_type == "TOOL" for s in t.data.spans))
print(exp, ppo, failed, trace)
EOF
)
ML=http://127.0.0.1:5000/#/experiments/$EXP
CLASSIC=workflowType=machine_learning
EXPAND='button[data-component-id$="runnamecellrenderer.tsx_46"]'
shot "$OUT/01-mlflow-runs-table.png" "$ML?$CLASSIC" --wait "rlhf/ppo" \
    --mlflow-columns "accuracy/base,accuracy/sft,accuracy/final,accuracy_gain" --click-css-all "$EXPAND" --size 1900x1000
shot "$OUT/02a-mlflow-ppo-run-metrics.png" "$ML/runs/$PPO_RUN/model-metrics?$CLASSIC" --wait "token_mean" --size 1600x1400
shot "$OUT/02b-mlflow-ppo-run-reward-charts.png" "$ML/runs/$PPO_RUN/model-metrics?$CLASSIC" --wait "token_mean" \
    --fill "Search metric charts=reward"
shot "$OUT/03a-mlflow-agent-trace.png" "$ML/traces?$CLASSIC" --wait "Question" --trace "$TRACE"
shot "$OUT/03b-mlflow-agent-trace-tool-span.png" "$ML/traces?$CLASSIC" --wait "Question" --trace "$TRACE" \
    --trace-span calculator
FORM=http://127.0.0.1:4200/deployments/deployment/$DEPLOYMENT/run
shot "$OUT/05a-prefect-deployment-form.png" "$FORM" --wait "overrides" --size 1600x2600
shot "$OUT/05b-prefect-deployment-form-values.png" "$FORM" --wait "overrides" --size 1600x2600 \
    --click-button str --click-button int --click-button list
shot "$OUT/06a-prefect-failed-run-missing-data.png" "http://127.0.0.1:4200/runs/flow-run/$C" \
    --wait "Finished in state Failed" --size 1600x1300
shot "$OUT/06b-prefect-failed-run-training-error.png" "http://127.0.0.1:4200/runs/flow-run/$D" \
    --wait "Finished in state Failed" --size 1600x1750
shot "$OUT/06c-mlflow-failed-stage-run.png" "$ML/runs/$FAILED_RUN?$CLASSIC" --wait "Failed"
shot "$OUT/06d-mlflow-runs-table-failed.png" "$ML?$CLASSIC" --wait "rlhf/ppo" --mlflow-columns "Description" \
    --click-css-all "$EXPAND" --size 2000x1000
step "done: $OUT (work folder $WD)"
