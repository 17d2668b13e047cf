PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: test demo bench install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Two workers (one per CI core; files with expensive module fixtures stay on one worker, see tests/conftest.py,
# the other tests are spread one by one); the slowest tests are printed at the end. TEST_ARGS=... passes more (e.g. TEST_ARGS="-n 0 -x").
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 $(TEST_ARGS)

demo: $(VENV)/.installed
	$(VENV)/bin/k3jax demo

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run --save; status=$$?; $(PY) -m benchmarks.report && exit $$status

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
