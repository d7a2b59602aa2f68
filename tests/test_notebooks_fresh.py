"""Committed notebooks show outputs of the code in this checkout (issue 23, item 5): each was executed and
stamped by `make lessons` (fabriclab/course/provenance.py), and none of the sources it depends on has changed
since. A failure names the notebook, the files that changed, and the fix."""
import json
import pathlib

import pytest

from fabriclab.course import provenance

LESSONS = pathlib.Path(__file__).resolve().parents[1] / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_committed_notebook_was_executed_against_this_code(notebook):
    why = provenance.staleness(notebook)
    assert why is None, why


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) > 10, f"no lessons found in {LESSONS}"


def code_notebook(*cells: str) -> dict:
    return {"cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": [], "execution_count": None}
                      for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def stamped(tmp_path):
    """A notebook that imports fabriclab.bootstrap and runs a module with python -m, stamped now."""
    path = tmp_path / "probe.ipynb"
    path.write_text(json.dumps(code_notebook("from fabriclab import bootstrap\n",
                                             "!python -m fabriclab.unidirectional --help\n")))
    provenance.stamp(path)
    return path


def test_a_stamp_records_the_machine_the_commit_and_every_source(stamped):
    record = json.loads(stamped.read_text())["metadata"]["fabriclab"]
    assert record["executed_on"]["cores"] >= 1 and "shm" in record["executed_on"]["providers"]
    assert len(record["commit"].split("+")[0]) == 40
    sources = record["sources"]
    # imported directly, run with -m, and imported by those in turn; the C of the extension fi loads
    assert {"<code cells>", "fabriclab/__init__.py", "fabriclab/bootstrap.py", "fabriclab/unidirectional.py",
            "fabriclab/fi/__init__.py", "native/core.c", "native/build_ffi.py"} <= set(sources)
    assert provenance.staleness(stamped) is None


def test_a_changed_source_makes_the_notebook_stale_and_names_the_file_and_the_fix(stamped):
    notebook = json.loads(stamped.read_text())
    notebook["metadata"]["fabriclab"]["sources"]["fabriclab/bootstrap.py"] = "0" * 64  # as if it was edited since
    stamped.write_text(json.dumps(notebook))
    why = provenance.staleness(stamped)
    assert why.startswith("probe.ipynb was executed at ") and "changed: fabriclab/bootstrap.py" in why
    assert "run `make lessons`" in why


def test_an_edited_cell_or_a_new_import_makes_the_notebook_stale(stamped):
    notebook = json.loads(stamped.read_text())
    notebook["cells"].append(code_notebook("from fabriclab.tools import doctor\n")["cells"][0])
    stamped.write_text(json.dumps(notebook))
    why = provenance.staleness(stamped)
    assert "changed: <code cells>" in why and "now depends on: " in why and "fabriclab/tools/doctor.py" in why


def test_a_notebook_never_stamped_says_how_to_stamp_it(tmp_path):
    path = tmp_path / "new.ipynb"
    path.write_text(json.dumps(code_notebook("print(1)\n")))
    assert provenance.staleness(path) == ("new.ipynb was never executed by `make lessons` (no fabriclab stamp in its "
                                          f"metadata): run `make lessons` (or `make lessons LESSONS={path.as_posix()}`"
                                          " for this one) and commit the notebook")


def test_a_script_a_cell_runs_counts_with_what_it_imports():
    notebook = code_notebook('EXAMPLES = lesson.project_file("examples")\n'
                             'subprocess.run([sys.executable, str(EXAMPLES / "kv_cache_transfer.py")])\n')
    sources = provenance.source_hashes(notebook)
    assert "examples/kv_cache_transfer.py" in sources and "fabriclab/engine.py" in sources
