"""Interpreter exit with engines still open (issue 31): a script that ends, normally or by an uncaught
exception, or that drops its engines unclosed, exits as it would without fabriclab: its own exit status,
no signal, nothing on stderr but its own traceback. At exit every engine stops its threads before any
libfabric object closes, whatever was opened first (the control channel's fabric opens after its engine)."""
import concurrent.futures
import os
import subprocess
import sys

import pytest

from conftest import PROVIDERS, available

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exiting_engines.py")
RUNS = 15  # each way: before the fix about one exit in six died of SIGSEGV, most printed thousands of lines
AT_ONCE = 3
OWN_TRACEBACK = ["Traceback (most recent call last):", f'  File "{SCRIPT}", line',
                 '    raise RuntimeError("the script\'s own error")', "RuntimeError: the script's own error"]


def exit_once(fabric: tuple[str, str | None], how: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, SCRIPT, fabric[0], fabric[1] or "-", how], capture_output=True,
                          text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def check_exits(fabric: tuple[str, str | None], how: str, runs: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        exits = list(pool.map(lambda _: exit_once(fabric, how), range(runs)))
    for rc, out, err in exits:
        assert out == "landing\n", err[-3000:]
        if how == "raise":
            lines = err.splitlines()
            assert rc == 1 and len(lines) == 4, err[-3000:]
            assert [line[:len(want)] for line, want in zip(lines, OWN_TRACEBACK)] == OWN_TRACEBACK, err[-3000:]
        else:
            assert (rc, err) == (0, ""), err[-3000:]


@pytest.mark.parametrize("how", ["end", "raise"])
def test_a_script_ending_with_a_staged_target_landing_exits_quietly(how):
    check_exits(available(PROVIDERS[0]), how, RUNS)


def test_a_script_dropping_its_engines_exits_quietly_while_they_close():
    check_exits(available(PROVIDERS[0]), "drop", 6)


@pytest.mark.parametrize("how", ["end", "raise", "drop"])
def test_the_same_over_tcp(how):
    check_exits(available(PROVIDERS[1]), how, 3)
