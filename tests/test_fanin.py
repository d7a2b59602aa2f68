"""Many writer processes into one target (python -m fabriclab fanin): every page counted, byte-exact, on
each provider; bad counts refused before any engine opens."""
import os
import subprocess
import sys

import pytest

from fabriclab.tools import fanin


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_three_writers_into_one_target_count_every_page(provider):
    r = fanin.run(provider, writers=3, pages=300, per_call=4, page=4096, threads=1, timeout=60)
    assert r["pages"] == 900 and r["pages_per_s"] > 0 and r["cores"] >= 1


@pytest.mark.parametrize("arg", ["--writers=0", "--pages=-1", "--per-call=0", "--writers=100000"])
def test_bad_counts_are_refused_with_the_bounds(arg):
    out = subprocess.run([sys.executable, "-m", "fabriclab", "fanin", arg], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "must be" in out.stderr and "Traceback" not in out.stderr


def fanin_command(*args, env=None):
    environ = {k: v for k, v in os.environ.items() if k != "FABRICLAB_SIM_PAYLOAD"}
    return subprocess.run([sys.executable, "-m", "fabriclab", "fanin", *args], capture_output=True, text=True,
                          timeout=120, env={**environ, **(env or {})})


def test_the_modeled_nics_are_checked_byte_for_byte_too():
    """The model moves no bytes unless told to: fanin turns its payload mode on (issue 31: it ended in a
    RuntimeError traceback, 'writer 0's pages are not byte-exact'), and a run told not to is refused."""
    done = fanin_command("--provider", "sim", "--writers", "2", "--pages", "40")
    assert done.returncode == 0 and "byte-exact" in done.stdout, done.stderr
    refused = fanin_command("--provider", "sim", "--writers", "2", "--pages", "40",
                            env={"FABRICLAB_SIM_PAYLOAD": "0"})
    assert refused.returncode == 2 and refused.stderr.startswith("error: fanin checks every page byte for byte")
    assert "run with FABRICLAB_SIM_PAYLOAD=1" in refused.stderr and refused.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [["--page-size", "64G"], ["--page-size", "1G", "--writers", "256"],
                                  ["--per-call", "65536", "--page-size", "16M"]])
def test_buffers_beyond_memory_are_refused_before_anything_starts(args):
    refused = fanin_command(*args)  # the issue: numpy's MemoryError, with its traceback
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "GiB available: use a smaller --page-size, fewer --writers or a smaller --per-call" in refused.stderr


def test_a_call_of_more_pages_than_the_slots_names_no_page_twice():
    done = fanin_command("--writers", "1", "--pages", "50", "--per-call", "40")
    assert done.returncode == 0 and "byte-exact" in done.stdout, done.stderr
