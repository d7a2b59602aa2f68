"""The modeled-NIC provider (sim) as libfabric's own tools and man pages see it: fi_pingpong through the
package's provider path, and the project's conformance checks (tests/sim_conformance.c, one process per
check: EQ/CQ/counter open and close, separate and shared CQs, selective completion, write and writedata
verified, gather/scatter, fi_getinfo's rules, AV close while bound, inserting the address of a peer already
gone, several threads on one domain), also
with the provider and the checks built under AddressSanitizer, and the threaded check under ThreadSanitizer."""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fabriclab import fi
from native_build import (ROOT, SANITIZER_ENV, compiler_with, libfabric_flags, sanitizer_flags,
                          sanitizer_reported)

HERE = Path(__file__).resolve().parent
PACKAGE_DIR = Path(fi.MODELED_PROVIDER_LIBRARY).parent
CHECKS = ["eq", "cntr", "cq_wait", "unsupported_answer", "av_close_while_bound", "av_insert_gone_peer", "separate_cqs",
          "shared_cq", "selective_completion", "write_verified", "failed_writes", "iov_limits", "getinfo", "threads",
          "host"]


def provider_env(provider_dir: Path, **extra) -> dict:
    """libfabric loads sim from provider_dir only (FI_PROVIDER_PATH), and offers nothing else (FI_PROVIDER)."""
    return {**os.environ, "FI_PROVIDER_PATH": str(provider_dir), "FI_PROVIDER": "sim", **extra}


def build(tmp_path: Path, sanitizer: str | None) -> tuple[Path, Path]:
    """The conformance program and a libsim-fi.so beside it, both built with the sanitizer (or none)."""
    cc = compiler_with(sanitizer, tmp_path)
    flags = sanitizer_flags(sanitizer)
    out = tmp_path / (sanitizer or "plain")
    out.mkdir()
    provider = subprocess.run([cc, *flags, "-shared", "-fPIC", "-fvisibility=hidden", "-Wall",
                               *map(str, sorted((ROOT / "native" / "sim").glob("*.c"))), *libfabric_flags(),
                               "-lfabric", "-lpthread", "-o", str(out / "libsim-fi.so")],
                              capture_output=True, text=True)
    assert provider.returncode == 0, provider.stderr
    program = subprocess.run([cc, *flags, "-Wall", str(HERE / "sim_conformance.c"), *libfabric_flags(), "-lfabric",
                              "-lpthread", "-o", str(out / "sim_conformance")], capture_output=True, text=True)
    assert program.returncode == 0, program.stderr
    return out / "sim_conformance", out


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    return build(tmp_path_factory.mktemp("conformance"), None)


def run_check(program: Path, provider_dir: Path, check: str, sanitizer: str | None = None):
    env = provider_env(provider_dir, **SANITIZER_ENV) if sanitizer else provider_env(provider_dir)
    result = subprocess.run([str(program), check], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"{check}: exit {result.returncode}\n{result.stdout}{result.stderr[-4000:]}")
    assert not sanitizer_reported(result.stderr), result.stderr[-4000:]


def test_the_program_lists_every_check(conformance):
    program, _ = conformance
    listed = subprocess.run([str(program), "list"], capture_output=True, text=True, timeout=10).stdout.split()
    assert listed == CHECKS


@pytest.mark.parametrize("check", CHECKS)
def test_conformance(conformance, check):
    program, _ = conformance
    run_check(program, PACKAGE_DIR, check)  # the provider the package built and loads


@pytest.mark.parametrize("check", [c for c in CHECKS if c != "threads"])
def test_conformance_under_address_sanitizer(tmp_path_factory, check, request):
    program, provider_dir = _sanitized(tmp_path_factory, request, "address")
    run_check(program, provider_dir, check, "address")


def test_threads_under_thread_sanitizer(tmp_path_factory, request):
    program, provider_dir = _sanitized(tmp_path_factory, request, "thread")
    run_check(program, provider_dir, "threads", "thread")


def _sanitized(tmp_path_factory, request, sanitizer):
    """One sanitized build per session (the cache lives on the pytest config)."""
    cache = request.config.__dict__.setdefault("_sim_sanitized_builds", {})
    if sanitizer not in cache:
        cache[sanitizer] = build(tmp_path_factory.mktemp(f"sim-{sanitizer}"), sanitizer)
    return cache[sanitizer]


# ---------------------------------------------------------------------------------------- fi_pingpong

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _pingpong():
    pingpong = shutil.which("fi_pingpong")
    if pingpong is None:
        pytest.skip("fi_pingpong is missing (libfabric-bin; scripts/install-system-deps installs it)")
    return pingpong


def _pingpong_pair(args: list[str]) -> tuple[subprocess.CompletedProcess, str, int]:
    """fi_pingpong's server, then its client on 127.0.0.1 (the control channel): the client, the server's output
    and exit status."""
    port = _free_port()
    env = provider_env(PACKAGE_DIR)
    server = subprocess.Popen(args + ["-B", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    try:
        deadline = time.monotonic() + 20
        while not _listening(port) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        client = subprocess.run(args + ["-P", str(port), "127.0.0.1"], capture_output=True, text=True, timeout=120,
                                env=env)
        served = server.communicate(timeout=60)[0]
    finally:
        server.kill()
        server.wait()
    return client, served, server.returncode


def test_fi_pingpong_runs_on_sim():
    """libfabric's own fi_pingpong over reliable datagrams, both sides, the sizes it runs by default (64 B to
    1 MiB), through the package's provider path."""
    client, served, server_rc = _pingpong_pair([_pingpong(), "-p", "sim", "-e", "rdm"])
    assert client.returncode == 0 and server_rc == 0, f"client:\n{client.stdout}{client.stderr}\nserver:\n{served}"
    rows = [line.split() for line in client.stdout.splitlines() if line.split()[:1] and line.split()[0][0].isdigit()]
    assert [row[0] for row in rows] == ["64", "256", "1k", "4k", "64k", "1m"], client.stdout
    assert all(row[1] == "10" and row[2] == "=10" for row in rows), client.stdout  # every ping answered


def test_fi_pingpong_default_endpoint_type_is_no_data_not_a_crash():
    """Without -e, fi_pingpong asks for unreliable datagrams (FI_EP_DGRAM), which the model does not offer (the
    p5's RDM endpoint is what it models): fi_getinfo says so, and both sides exit cleanly."""
    client, served, server_rc = _pingpong_pair([_pingpong(), "-p", "sim"])
    assert client.returncode > 0 and server_rc > 0, f"client:\n{client.stdout}{client.stderr}\nserver:\n{served}"
    assert "fi_getinfo" in served and "-61" in served, served


def test_the_host_extension_is_refused_on_the_wall_clock(conformance):
    """FABRICLAB_SIM_TIME=wall: the provider runs on the wall clock and offers no modeled clock (check_host's
    other branch); an engine then times its runs on the wall clock."""
    program, _ = conformance
    env = provider_env(PACKAGE_DIR, FABRICLAB_SIM_TIME="wall")
    result = subprocess.run([str(program), "host"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
