"""The tools under bad input: deadlines that cannot work are refused by argparse, and a client given the
address of a server that is gone says so, and what to do."""
import subprocess
import sys
import time

import pytest

from fabriclab import multi_nic, shmclean, unidirectional
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
