"""The tools under bad input: deadlines that cannot work are refused by argparse, and a client given the
address of a server that is gone says so, and what to do."""
import os
import subprocess
import sys
import time

import pytest

from fabriclab import batched, multi_nic, shmclean, unidirectional
from fabriclab.__main__ import build_parser
from fabriclab.tools.peers import start_server
from conftest import provider_args

ADDRESS = "00"  # never parsed: argparse refuses the options first


@pytest.mark.parametrize("parse, option", [
    (lambda argv: build_parser().parse_args(["bench", *argv]), "--timeout"),
    (lambda argv: multi_nic.build_parser().parse_args(["connect", ADDRESS, *argv]), "--timeout"),
    (lambda argv: unidirectional.build_parser().parse_args(["serve", *argv]), "--timeout"),
    (lambda argv: build_parser().parse_args(["bench", *argv]), "--link-timeout"),
    (lambda argv: multi_nic.build_parser().parse_args(["connect", ADDRESS, *argv]), "--link-timeout"),
], ids=["bench", "multi_nic", "unidirectional", "bench-link", "multi_nic-link"])
def test_deadlines_must_be_finite_and_positive(parse, option, capsys):
    link = option == "--link-timeout"  # 0 turns failover off; a --timeout of 0 would fail every wait at once
    for value in ["-1", "nan", "inf", "-inf", "soon"] + ([] if link else ["0"]):
        with pytest.raises(SystemExit) as exit_:
            parse([f"{option}={value}"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: '{value}'" in err and "a finite number larger than zero" in err, err
        assert ("or 0 to turn failover off" in err) == link, err
    assert getattr(parse([f"{option}=0.5"]), option[2:].replace("-", "_")) == 0.5
    if link:
        assert parse([f"{option}=0"]).link_timeout == 0


CORES = min(os.cpu_count() or 1, 256)  # and FL_MAX_THREADS


@pytest.mark.parametrize("option, value, message", [
    ("--nics", "0", "NIC slots must be between 1 and 1024, got 0 (slots beyond this machine's NICs are emulated"),
    ("--nics", "100000", "NIC slots must be between 1 and 1024, got 100000"),
    # more than the cores is refused by the stage, on a provider whose time is the wall clock (not on the model)
    ("--threads", "0", "threads must be between 1 and 256, got 0 (the engine's limit"),
    ("--threads", "1000", "threads must be between 1 and 256, got 1000"),
    ("--threads", "1.5", "threads must be an integer, got '1.5'"),
    ("--batch", "0", "writes enqueued per pass must be between 1 and 65536, got 0"),
    ("--groups", "0", "GPU groups must be between 1 and 1024, got 0"),
    ("--in-flight", "-1", "pages in flight must be at least 1, got -1"),
])
def test_counts_are_bounded_whatever_the_stage(option, value, message, capsys):
    """Issue 21: bench took --nics 0 / 100000, --threads 0 / 1000 and --batch 0 on its default stage, which
    does not use them. Refused by argparse, as a bad deadline is, by bench and by the stages that share them."""
    parsers = [lambda argv: build_parser().parse_args(["bench", *argv]),
               lambda argv: batched.build_parser().parse_args(["connect", ADDRESS, *argv])]
    for parse in parsers:
        with pytest.raises(SystemExit) as exit_:
            parse([option, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: '{value}': {message}" in err, err
        assert getattr(parse([option, "1"]), option[2:].replace("-", "_")) == 1
    assert build_parser().parse_args(["bench", "--threads", str(CORES)]).threads == CORES


def test_topo_draw_to_a_path_it_cannot_write_says_so(tmp_path):
    """Issue 21: ``topo --draw /nonexistent/x.svg`` printed a raw traceback. A path in a missing or unwritable
    directory, a directory, or a format matplotlib does not write is refused before the machine is looked at."""
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o500)
    cases = [("/nonexistent/x.svg", "the directory /nonexistent does not exist"),
             (str(tmp_path / "x.doc"), "'.doc' is not a format matplotlib writes: name a .png, .svg or .pdf file"),
             (str(tmp_path), "is a directory: name a file"),
             (str(tmp_path / "x"), "'' is not a format matplotlib writes")]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((str(readonly / "x.png"), f"the directory {readonly} is not writable"))
    for path, message in cases:
        done = subprocess.run([sys.executable, "-m", "fabriclab", "topo", "--recorded", "p5.48xlarge", "--draw", path],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        assert f"argument --draw: '{path}': {message}" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not done.stdout
    # /proc takes no new files, whatever access() says: the save itself fails, and says so
    done = subprocess.run([sys.executable, "-m", "fabriclab", "topo", "--recorded", "p5.48xlarge", "--draw",
                           "/proc/x.png"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "/proc/x.png" in done.stderr and "Traceback" not in done.stderr, done


def test_connect_to_a_server_that_is_gone_says_so(fabric):
    with start_server("fabriclab.multi_nic", *provider_args(*fabric)) as server:
        address = server.address_hex
        server.kill()  # SIGKILL: nothing tells the client
    shmclean.reclaim_stale_shm_regions()  # what the kill left (shm regions, owner record): not the test's to keep
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fabriclab.multi_nic", "connect", address, "--timeout", "1",
                           *provider_args(*fabric)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert done.returncode == 1
    assert done.stderr.startswith("error: no answer from the server at "), done.stderr
    assert "within 1 s: the server is probably gone; restart it and connect to the new address it prints" \
        in done.stderr
    assert "EAGAIN" not in done.stderr and "Traceback" not in done.stderr
    # Chapter 4's sender, the base of every client, says the same.
    with unidirectional.open_endpoint(*fabric) as stack:
        with pytest.raises(unidirectional.ServerSilent, match="no answer from the server at .* within 0.5 s"):
            unidirectional.Sender(stack, address, timeout=0.5).send(b"anyone?")
