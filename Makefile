# moe-hang: `make demo` and `make test` work on a fresh clone with nothing installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build lies on this machine kind's disk; on a GPU machine the same pin is the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.moe-hang-installed
PYTEST_ARGS ?=
# make fuzz: N runs (a mirrored twin is a run) of generated jobs from seed SEED
SEED ?= 1
N ?= 200
# Every test and job starts Python processes that import this checkout: with
# PYTHONDONTWRITEBYTECODE set (some CI images and sandboxes set it) each one compiles every
# module again (~0.5 s a start; one end-to-end test 8.7 s against 5.2 s). Bytecode goes to
# the ignored __pycache__ directories.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast test-matrix lint bench bench-quick soak corpus corpus-deps \
	corpus-fast fuzz fuzz-smoke clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# repro exits 3 when it reproduces the hang: that is the expected outcome here.
demo: setup
	@$(VENV)/bin/moe-hang repro; rc=$$?; \
	if [ $$rc -ne 3 ]; then echo "demo: repro did not reproduce the hang (exit $$rc)"; exit 1; fi
	$(VENV)/bin/moe-hang verify --fixed

# lint first, as its own step (a minute), then every test on three pytest-xdist workers: most
# end-to-end tests wait (stall windows, a job's own sleeps) rather than compute, and two
# workers kept this machine's two cores 74 % busy. From a fresh clone, 2026-12-05: 604-627 s
# of pytest, 10 min 48 s to 11 min 9 s in all (two workers: 709 s, 12 min 30 s; JOBS=0 runs
# them one at a time, 1116 s when last measured). The tool is meant for a loaded machine:
# the load brought out a race once (a healthy job called dead: a stack older than its
# rank's recorder dump), fixed in the model since. The 20 slowest are listed at the end
JOBS ?= 3
test: setup lint
	$(PY) -m pytest -q -n $(JOBS) --durations=20 $(PYTEST_ARGS)

# the pure and in-process tests and the house rules (no torchrun): about two minutes
test-fast: setup
	$(PY) -m pytest -q tests/unit tests/test_layout.py $(PYTEST_ARGS)

test-matrix: setup
	$(PY) -m pytest -q -m matrix --matrix $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check moe_hang tests scripts
	$(VENV)/bin/mypy

# the accuracy corpus (tests/corpus): every case and its mirror, with the real third-party
# code (transformers + peft, torch pinned so nothing else is pulled); table + JSON.
# NeMo Automodel releases go each into a directory of their own (--no-deps: the layer needs
# torch only, and 0.5.0 pins transformers 5), which their cases put on the job's PYTHONPATH;
# a release that cannot be fetched leaves its cases skipped, with the reason
AUTOMODEL_VERSIONS ?= 0.5.0 0.7.0
# transformers 5 (fused experts) in a directory of its own, with its dependencies (huggingface_hub
# 1.x and the rest; not torch): its job puts it first on PYTHONPATH
TRANSFORMERS5 ?= 5.25.0
# torchtitan's MoE file, read by path in a unit test (its package imports triton at import)
TORCHTITAN ?= 0.2.2
CORPUS_PKGS := $(VENV)/corpus

corpus-deps: setup
	@$(PY) -c "import transformers, peft" 2>/dev/null || (echo "$(TORCH_SPEC)" > $(VENV)/torch-pin.txt && $(PY) -m pip install -q -e ".[corpus]" -c $(VENV)/torch-pin.txt)
	@for v in $(AUTOMODEL_VERSIONS); do d=$(CORPUS_PKGS)/nemo-automodel-$$v; \
	  test -d $$d/nemo_automodel-$$v.dist-info && continue; rm -rf $$d $$d.tmp; \
	  if $(PY) -m pip install -q --no-deps --no-compile --target $$d.tmp "nemo-automodel==$$v"; \
	  then mv $$d.tmp $$d; else rm -rf $$d.tmp; \
	  echo "corpus: nemo-automodel $$v not installed: its cases will be skipped"; fi; done
	@d=$(CORPUS_PKGS)/transformers-$(TRANSFORMERS5); test -d $$d/transformers-$(TRANSFORMERS5).dist-info || \
	  { rm -rf $$d $$d.tmp; if $(PY) -m pip install -q --no-compile --target $$d.tmp "transformers==$(TRANSFORMERS5)"; \
	  then mv $$d.tmp $$d; else rm -rf $$d.tmp; \
	  echo "corpus: transformers $(TRANSFORMERS5) not installed: its cases will be skipped"; fi; }
	@d=$(CORPUS_PKGS)/torchtitan-$(TORCHTITAN); test -d $$d/torchtitan-$(TORCHTITAN).dist-info || \
	  { rm -rf $$d $$d.tmp; if $(PY) -m pip install -q --no-deps --no-compile --target $$d.tmp "torchtitan==$(TORCHTITAN)"; \
	  then mv $$d.tmp $$d; else rm -rf $$d.tmp; \
	  echo "corpus: torchtitan $(TORCHTITAN) not installed: its test will be skipped"; fi; }

corpus: corpus-deps
	$(PY) scripts/corpus.py --json runs/corpus.json

corpus-fast: setup
	$(PY) -m pytest -q -m corpus tests/corpus $(PYTEST_ARGS)

# generated jobs with planted faults through the real CLI (moe_hang/testing/fuzz): a line per
# run, the table by fault kind, and last `accuracy: R/N runs fully right`; every family needs
# torch only (no extra to install)
fuzz: setup
	$(PY) scripts/fuzz.py --seed $(SEED) -n $(N)

# three generated runs through the CLI under pytest (not in `make test`: --fuzz)
fuzz-smoke: setup
	$(PY) -m pytest -q -m fuzz --fuzz tests/e2e/test_fuzz_smoke.py $(PYTEST_ARGS)

bench: setup
	$(PY) scripts/bench.py

bench-quick: setup
	$(PY) scripts/bench.py --quick

soak: setup
	$(PY) scripts/soak.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache *.egg-info
