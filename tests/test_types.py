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


def test_the_front_door_types_the_engine_and_its_keywords(tmp_path):
    """``from fabriclab import Engine`` is the class to a type checker (not Any, as the lazy import alone would
    make it), and a wrong keyword or a wrong value type for one is an error before anything runs."""
    use = tmp_path / "use_engine.py"
    use.write_text("import fabriclab\nfrom fabriclab import Engine\n\n"
                   "reveal_type(fabriclab.Engine)\n"
                   "reveal_type(Engine('shm', nics=2, domains='lo').address)\n"
                   "Engine('shm', nics='4')\n"
                   "Engine('shm', thread=2)\n")
    run = mypy(str(use))
    assert 'Revealed type is "def (provider: str | None =' in run.stdout and "-> fabriclab.engine.Engine" in run.stdout
    assert 'Revealed type is "bytes"' in run.stdout, run.stdout
    assert run.stdout.count("error:") == 2 and '"nics"' in run.stdout and '"thread"' in run.stdout, run.stdout


def test_the_engine_keywords_are_the_config_fields():
    import dataclasses
    import typing

    from fabriclab.config import EngineConfig, EngineOptions
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"provider"}
    assert set(typing.get_type_hints(EngineOptions)) == fields
