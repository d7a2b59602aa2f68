# The two commands of the README: `make tour` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fabriclab-installed

.PHONY: tour test types setup system-deps lab clean

tour: setup
	$(PY) -m fabriclab tour --lessons lessons --out build/lessons

test: setup
	$(PY) -m pytest tests lessons --nbval -p no:cacheprovider

# mypy --strict on the public API ([tool.mypy] in pyproject.toml); `make test` runs it too (tests/test_types.py).
types: setup
	$(PY) -m mypy

setup: system-deps $(STAMP)

system-deps:
	@scripts/install-system-deps

$(STAMP): pyproject.toml setup.py $(wildcard native/*) $(wildcard native/sim/*.c native/sim/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[lab,test]'
	@touch $@

lab: setup
	$(VENV)/bin/jupyter lab lessons/

clean:
	rm -rf build $(VENV) fabriclab/_fabric*.so fabriclab/libsim-fi.so native/sim/build *.egg-info
