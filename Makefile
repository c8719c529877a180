# Set-up is just `make demo` or `make test`: each builds .venv on first use.
# Stamps live inside .venv, so deleting .venv forces a clean reinstall, and an
# edit to pyproject.toml re-runs the install.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Pinned: this version resolves to the CPU wheel here; an unpinned `torch`
# would pull the multi-GB CUDA build.
TORCH  := torch==2.13.0
PROMPT := The with statement is used to

.PHONY: demo test .venv

.venv: $(PY)

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.stamp-run: pyproject.toml | $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml | $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[dev]'
	touch $@ $(VENV)/.stamp-run

demo: $(VENV)/.stamp-run
	$(VENV)/bin/kvfold generate --model tiny --prompt "$(PROMPT)" \
		--max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 0

# The batch-invariance and placement-exactness tests run twice: with the kernels MKL, ATen and
# kvfold's own native build pick on this machine, and held to AVX2, so one machine checks that no
# guarantee rests on either instruction set's kernels.
test: $(VENV)/.stamp-dev
	$(PY) -m pytest -q
	MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 KVFOLD_NATIVE_ISA=avx2 $(PY) -m pytest -q -m "batch_invariance or exactness"
