"""The modeled p5 NICs (provider sim, native/sim/, docs/model.md) under the binding: what it reports,
messages, writes with immediate data, errors, payload mode, the line rate as a lower bound on a write's
completion time, two processes, and no shared memory left after exit or SIGKILL."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fabriclab import fi
from helpers import LINE_TIMEOUT, Child, python

HERE = Path(__file__).resolve().parent
NIC_A, NIC_B = "rdmap16s0-rdm", "rdmap17s0-rdm"


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter: libfabric reads the provider path and the model's settings once per process."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.fixture
def pair():
    if fi.MODELED_PROVIDER not in fi.available_providers():
        pytest.skip("sim is not loaded in this process (libfabric started without it)")
    a = fi.EndpointStack(fi.getinfo("sim", NIC_A)[0])
    b = fi.EndpointStack(fi.getinfo("sim", NIC_B)[0])
    yield a, b, a.av.insert(b.ep.address()), b.av.insert(a.ep.address())
    a.close()
    b.close()


def pump(stacks, wanted, timeout=5.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < wanted and time.monotonic() < deadline:
        for s in stacks:
            got.extend(s.cq.poll())
    return got


def test_reports_a_p5_shaped_host():
    infos = fi.domains("sim")
    assert len(infos) == 32
    info = infos[0]
    assert (info.provider, info.domain, info.fabric) == ("sim", NIC_A, "modeled-p5")
    assert info.caps & fi.lib.FI_MSG and info.caps & fi.lib.FI_RMA
    # as the p5's efa reports it (../shared/reference/figures.md): no FI_MR_LOCAL
    assert set(info.mr_mode_names) == {"FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_PROV_KEY", "FI_MR_HMEM"}
    assert (info.tx_size, info.rx_size, info.inject_size, info.cq_data_size) == (4096, 8192, 4096, 4)
    assert info.nic.link_speed_bps == 100_000_000_000
    assert info.modeled and not info.moves_payload
    assert fi.default_provider() != "sim"


def test_nic_count_follows_the_environment():
    out = run_python("from fabriclab import fi; print(len(fi.domains('sim')))", FABRICLAB_SIM_NICS="4")
    assert out.stdout.strip() == "4", out.stderr


def test_asked_for_after_libfabric_started_is_a_clear_error():
    out = run_python("from fabriclab import fi; fi.getinfo('shm')\n"
                     "try:\n    fi.getinfo('sim')\nexcept fi.UsageError as e:\n    print(e)",
                     FABRICLAB_PROVIDER="", FI_PROVIDER_PATH="")
    assert "FABRICLAB_PROVIDER=sim" in out.stdout, out.stderr


def test_send_and_receive(pair):
    a, b, to_b, _ = pair
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    ms, md = a.register(src), b.register(dst)
    b.ep.post_recv(md, 0, 4096, "recv")
    a.ep.post_send(ms, 0, 1000, to_b, "send")
    got = pump([a, b], 2)
    assert sorted((c.token, c.length) for c in got) == [("recv", 1000), ("send", 1000)]
    assert np.array_equal(dst[:1000], src[:1000])


def test_write_with_immediate_data_and_its_time_on_the_line(pair):
    a, b, to_b, _ = pair
    size = 8 << 20
    ms, md = a.register(np.ones(size, dtype=np.uint8)), b.register(np.zeros(size, dtype=np.uint8))
    clock = a.cq.modeled_clock() or time.monotonic_ns  # this thread's time on the modeled host
    start = clock()
    a.ep.post_write(ms, 0, size, to_b, md.remote(), 0, "w", data=0xDEADBEEF)
    got = pump([a, b], 2)
    elapsed = (clock() - start) / 1e9
    assert {(c.token, c.data if c.has_data else None) for c in got} == {("w", None), (None, 0xDEADBEEF)}
    assert elapsed >= size * 8 / 100e9  # a lower bound only: the wire time of 8 MiB at 100 Gbps


def test_bad_key_range_and_address_are_error_completions(pair):
    a, b, to_b, _ = pair
    ms, md = a.register(np.ones(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
    good = md.remote()
    for remote, offset, name in ((fi.RemoteRegion(good.base, good.length, good.key ^ 1), 0, "FI_EKEYREJECTED"),
                                 (fi.RemoteRegion(good.base, good.length * 2, good.key), 4096, "EFAULT"),
                                 (fi.RemoteRegion(good.base + (1 << 30), good.length, good.key), 0, "EFAULT")):
        a.ep.post_write(ms, 0, 64, to_b, remote, offset, "bad", data=1)
        with pytest.raises(fi.FabricError, match=name) as err:
            pump([a], 1)
        assert err.value.token == "bad"
    with pytest.raises(fi.FabricError, match="fi_writemsg"):
        a.ep.post_write(ms, 0, 64, 99, good, 0, "no such peer")


def test_a_fresh_endpoint_on_the_same_cq_and_av_as_the_engine_renews_one(pair):
    """The Engine's endpoint renewal: a second endpoint bound to a stack's CQ and AV, both writing, both
    completing on that CQ; the old one closes while the fresh one keeps working (issue 22 finding 8)."""
    a, b, to_b, _ = pair
    fresh = fi.Endpoint(a.domain, a.cq, a.av)
    try:
        src, dst = a.register(np.ones(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
        a.ep.post_write(src, 0, 64, to_b, dst.remote(), 0, "old", data=1)
        fresh.post_write(src, 0, 64, to_b, dst.remote(), 64, "fresh", data=2)
        got = pump([a, b], 4)
        assert sorted(str(c.token) for c in got) == ["None", "None", "fresh", "old"]
        assert sorted(c.data for c in got if c.has_data) == [1, 2]
        a.ep.close()
        fresh.post_write(src, 0, 64, to_b, dst.remote(), 128, "after", data=3)
        assert sorted(str(c.token) for c in pump([a, b], 2)) == ["None", "after"]
    finally:
        fresh.close()


def test_binding_tree_closes_cleanly_and_twice(pair):
    a, *_ = pair
    a.register(np.zeros(64, dtype=np.uint8))
    a.close()
    a.close()
    assert a.closed


def sim_peer(nic: str, count: int, **env) -> Child:
    """tests/sim_peer.py in a process of its own, serving until ``count`` immediate data have arrived; its first
    line (its address and region) is the caller's to read."""
    return Child(python(str(HERE / "sim_peer.py"), nic, count), env={**os.environ, **env})


def _two_processes(env, count, payload):
    peer = sim_peer(NIC_B, count, **env)
    address, region = peer.line(LINE_TIMEOUT, "the peer's address and region").split()
    code = (f"import numpy as np\nfrom fabriclab import fi\n"
            f"s = fi.EndpointStack(fi.getinfo('sim', '{NIC_A}')[0])\n"
            f"dest = s.av.insert(fi.Address.parse('{address}'))\n"
            f"remote = fi.RemoteRegion.unpack(bytes.fromhex('{region}'))\n"
            f"mr = s.register(np.full(1 << 20, 3, dtype=np.uint8))\n"
            f"for i in range({count}):\n"
            f"    s.ep.post_write(mr, 0, 4096, dest, remote, i * 4096, i, data=i)\n"
            f"done = 0\n"
            f"while done < {count}:\n"
            f"    done += len(s.cq.poll())\n"
            f"s.close()\n")
    writer = run_python(code, **env)
    assert writer.returncode == 0, writer.stderr
    landed, total = peer.line(LINE_TIMEOUT, "what landed").rsplit(" ", 1)
    peer.close()
    return sorted(map(int, landed.split())), int(total), peer


def test_two_processes_each_immediate_data_once():
    landed, total, _ = _two_processes({"FABRICLAB_PROVIDER": "sim"}, 50, payload=False)
    assert landed == list(range(50))
    assert total == 0  # no payload moves by default


def test_payload_mode_is_byte_exact():
    env = {"FABRICLAB_PROVIDER": "sim", "FABRICLAB_SIM_PAYLOAD": "1"}
    landed, total, _ = _two_processes(env, 50, payload=True)
    assert landed == list(range(50))
    assert total == 50 * 4096 * 3


def _sim_segments(pid):
    """The model's shared segments a process holds (memfds, so nothing is ever named in /dev/shm)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    return [p for p in fd_dir.iterdir() if "fabriclab-sim" in os.readlink(p)]


def test_no_shared_memory_left_after_exit_or_sigkill():
    for ending in ("exit", "kill"):
        peer = sim_peer(NIC_B, 1, FABRICLAB_PROVIDER="sim")
        peer.line(LINE_TIMEOUT, "the peer's address and region")
        assert _sim_segments(peer.pid)
        if ending == "kill":
            peer.signal(signal.SIGKILL)
        else:
            peer.stdin.close()
            peer.signal(signal.SIGTERM)
        peer.wait()
        # the segment is a memfd: the kernel frees it with the last process holding it, however that ends
        assert not [name for name in os.listdir("/dev/shm") if "sim" in name]


def test_dead_peer_is_an_error_not_a_hang(pair):
    peer = sim_peer(NIC_B, 1000000, FABRICLAB_PROVIDER="sim")
    address, region = peer.line(LINE_TIMEOUT, "the peer's address and region").split()
    a, *_ = pair
    dest = a.av.insert(fi.Address.parse(address))
    mr = a.register(np.zeros(4096, dtype=np.uint8))
    peer.kill()
    peer.wait(10)
    time.sleep(0.05)
    with pytest.raises(fi.FabricError, match="EHOSTUNREACH"):
        a.ep.post_write(mr, 0, 64, dest, fi.RemoteRegion.unpack(bytes.fromhex(region)), 0, "late", data=1)
        pump([a], 1)
