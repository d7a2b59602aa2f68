"""Many writer processes into one target (python -m fabriclab fanin): every page counted, byte-exact, on
each provider; bad counts refused before any engine opens."""
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
