"""The API reference builds from the docstrings, names every public object, and a broken docstring
reference fails the build (so `make test` catches it)."""
import argparse
import inspect
import subprocess
import sys

import pytest

import fabriclab
from fabriclab import Engine, bootstrap, engine
from fabriclab.tools import apidoc


def public_names():
    """Every name the reference must show, found here independently of apidoc."""
    names = []
    for name in fabriclab.__all__:
        obj = getattr(fabriclab, name)
        names.append(f"### class `{name}`")
        names += [f"`{name}.{member}`" for member in vars(obj)
                  if not member.startswith("_") and (inspect.isfunction(vars(obj)[member])
                                                     or isinstance(vars(obj)[member], property))]
    for name, obj in vars(bootstrap).items():
        if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                and obj.__module__ == bootstrap.__name__:
            names.append(f"`{name}`")
    return names


@pytest.mark.parametrize("command", [["-m", "fabriclab.tools.apidoc"], ["-m", "fabriclab", "apidoc"]],
                         ids=["module", "cli"])
def test_reference_builds_and_names_every_public_object(tmp_path, command):
    out = tmp_path / "API.md"
    done = subprocess.run([sys.executable, *command, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "has no docstring" not in done.stderr
    text = out.read_text()
    missing = [name for name in public_names() if name not in text]
    assert not missing, f"the reference lacks {missing}"
    assert "## `fabriclab.engine`" in text and "## `fabriclab.bootstrap`" in text
    assert "*(undocumented)*" not in text


def test_a_broken_reference_fails_the_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Engine.register, "__doc__", "Register it; see ``Region.no_such_method``.")
    out = tmp_path / "API.md"
    assert apidoc.main(argparse.Namespace(out=str(out))) == 1
    err = capsys.readouterr().err
    assert "fabriclab.engine.Engine.register" in err and "Region.no_such_method" in err
    assert not out.exists()


def test_the_rule():
    write = apidoc.Doc("fabriclab.engine.Peer.write_pages", "", engine, owner=engine.Peer,
                       params=apidoc.parameters(engine.Peer.write_pages))
    module = apidoc.Doc("fabriclab.engine", "", engine, classes=(engine.Engine, engine.TransferError))
    good = ["Transfer.writes", "page_size", "local_region", "Engine(timeout=...)", "write",
            "concurrent.futures.Future", "fabriclab.topology", "__dlpack__", "native/core.c",
            "src_pages[i]", "42", "Engine.address", "fi.FabricTimeout"]
    bad = ["Transfer.nope", "page_size.real", "no_such_name", "fabriclab.nope", "engine_address"]
    for ref in good:
        assert apidoc.resolves(ref, write), ref
    for ref in bad:
        assert not apidoc.resolves(ref, write), ref
    assert apidoc.resolves("buffer_safe", module) and not apidoc.resolves("buffer_unsafe", module)
    assert apidoc.references("see :class:`PeerLost` and ``x``") == ["PeerLost", "x"]
