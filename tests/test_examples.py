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


def run_kv(*args):
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, "kv_cache_transfer.py"), *args],
                          capture_output=True, text=True, timeout=120)


def torch_sees_a_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_kv_cache_example_falls_back_to_host_tensors_and_says_why():
    if torch_sees_a_gpu():
        pytest.skip("this machine has a GPU: the example uses it (test_kv_cache_example_moves_torch_cuda_tensors)")
    done = run_kv("--rounds", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(host; no GPU here: torch:" in done.stdout  # the reason, naming what was tried
    forced = run_kv("--memory", "cuda")
    assert forced.returncode == 1 and "--memory cuda needs a CUDA GPU" in forced.stdout + forced.stderr


@pytest.mark.gpu
def test_kv_cache_example_moves_torch_cuda_tensors():
    if not torch_sees_a_gpu():
        pytest.skip("needs torch with a CUDA GPU")
    done = run_kv("--block-bytes", "1M", "--layers", "8", "--request-blocks", "16")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(cuda, torch, cuda-" in done.stdout and "[decode] cache in cuda-" in done.stdout, done.stdout
