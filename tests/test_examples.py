"""The example scripts run end to end as a user would start them: exit status 0 and their success line."""
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.parametrize("script, success", [("kv_cache_transfer.py", "kv_cache_transfer: OK"),
                                             ("weight_broadcast.py", "weight_broadcast: OK")])
def test_example_runs_and_succeeds(script, success):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{script} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert any(line.startswith(success) for line in done.stdout.splitlines()), done.stdout
