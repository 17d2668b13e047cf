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

test: $(VENV)/.installed
	$(PY) -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/k3jax demo

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run --save; status=$$?; $(PY) -m benchmarks.report && exit $$status

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
