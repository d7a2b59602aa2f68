"""The public API's hints type-check: mypy --strict on the modules pyproject.toml's [tool.mypy] lists
(fabriclab/__init__.py's exports and the modules they come from, the binding fabriclab.fi, ...), with the
stub of the cffi module (fabriclab/_fabric.pyi). A module joins the list once it passes."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mypy(*args: str) -> subprocess.CompletedProcess:
    """mypy with the project's configuration (pyproject.toml), run from the repository's root."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is not installed: pip install -e '.[test]' (it is in the test extra)")
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_the_public_api_type_checks():
    run = mypy()
    assert run.returncode == 0, f"mypy --strict finds errors in the public API:\n{run.stdout}{run.stderr}"
    assert "Success: no issues found" in run.stdout, run.stdout


def test_the_check_is_strict_and_sees_the_binding(tmp_path):
    # The test above passes vacuously if the configuration checks nothing, or nothing strictly: a module
    # with an unhinted function and a wrong call into fabriclab.fi must fail under it.
    bad = tmp_path / "bad_hints.py"
    bad.write_text("from fabriclab import fi\n\n\n"
                   "def unhinted(x):\n    return x\n\n\n"
                   "def wrong() -> int:\n    return fi.integer(3, 'n', minimum='one')\n")
    run = mypy(str(bad))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no-untyped-def" in run.stdout and "arg-type" in run.stdout, run.stdout
