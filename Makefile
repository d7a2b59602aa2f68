# The two commands of the README: `make tour` and `make test`. Both set up what is missing first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fabriclab-installed

.PHONY: tour test types lessons setup system-deps lab clean

tour: setup
	$(PY) -m fabriclab tour --lessons lessons --out build/lessons

# The tests run in TEST_WORKERS processes (pytest-xdist; each test file whole in one: module fixtures stay
# shared), as most of their time is waiting on peers, timeouts and children; the lessons then run alone,
# since their checked facts compare measured figures and must not share the cores.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider --durations=25
	$(PY) -m pytest lessons --nbval -p no:cacheprovider --durations=10

# Re-execute the committed notebooks in place and stamp each with what it ran on and the hashes of the code it
# depends on (fabriclab/course/provenance.py); tests/test_notebooks_fresh.py fails when that code changes
# afterwards. One notebook: `make lessons LESSONS=lessons/02_philosophy.ipynb`. A notebook that fails or
# runs past LESSON_TIMEOUT seconds is left unstamped and named; the others go on.
LESSONS        ?= $(sort $(wildcard lessons/*.ipynb))
LESSON_TIMEOUT ?= 900

lessons: setup
	@failed=""; for nb in $(LESSONS); do \
	  echo "executing $$nb"; \
	  if timeout --kill-after=30 $(LESSON_TIMEOUT) $(VENV)/bin/jupyter nbconvert --to notebook --execute \
	       --inplace --ExecutePreprocessor.timeout=$(LESSON_TIMEOUT) --log-level=WARN "$$nb" \
	     && $(PY) -m fabriclab.course.provenance stamp "$$nb"; then :; else failed="$$failed $$nb"; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "make lessons: not executed or not stamped (failed, or over $(LESSON_TIMEOUT) s):$$failed" >&2; exit 1; fi

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
