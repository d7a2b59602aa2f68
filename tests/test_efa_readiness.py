"""What a real p5 needs of fabriclab, checked where it can be here (issue 16): the fabric chosen by name
and with enough immediate data, the CUDA-API question, the error entry read with a clean struct."""
import subprocess
import sys
import types

import numpy as np
import pytest

from fabriclab import cli, fi, nics


def efa_listing():
    """How libfabric 2.x lists a p5's NICs: every NIC under efa-direct first, then under efa (RDM)."""
    names = [f"rdmap{n}s0-rdm" for n in (79, 80, 81, 82)]
    return ([types.SimpleNamespace(provider="efa", fabric="efa-direct", domain=d) for d in names]
            + [types.SimpleNamespace(provider="efa", fabric="efa", domain=d) for d in names])


def test_the_rdm_fabric_wins_where_efa_lists_efa_direct_first():
    listing = efa_listing()
    chosen = fi.one_fabric_per_nic(listing)
    assert [i.fabric for i in chosen] == ["efa"] * 4
    assert [i.domain for i in chosen] == [i.domain for i in listing[:4]]  # NIC order kept
    assert fi.provider_fabric_first(listing)[0].fabric == "efa"  # what a single endpoint (getinfo()[0]) gets


def test_tcp_keeps_one_fabric_per_interface():
    domains = [i.domain for i in fi.domains("tcp;ofi_rxm")]
    assert len(domains) == len(set(domains)) and "lo" in domains


def test_the_hints_ask_for_the_immediate_data_every_write_carries():
    hints = fi._hints("shm", fi.DEFAULT_CAPS, fi.lib.FI_EP_RDM, fi.IMMEDIATE_DATA_BYTES)
    try:
        assert hints.domain_attr.cq_data_size == fi.IMMEDIATE_DATA_BYTES == 4
    finally:
        fi.lib.fi_freeinfo(hints)
    assert all(i.cq_data_size >= 4 for i in fi.getinfo("shm"))
    # a provider offering less than asked is refused by fi_getinfo itself, with the reason named
    with pytest.raises(fi.UsageError, match="less than 64 bytes of immediate data"):
        fi.getinfo("shm", cq_data_size=64)


def test_a_fabric_is_asked_for_by_name(monkeypatch):
    assert {i.domain for i in fi.getinfo("tcp;ofi_rxm", fabric="127.0.0.1/32")} == {"lo"}
    with pytest.raises(fi.UsageError, match="no fabric 'efa-direct'.*its fabrics here: shm"):
        fi.getinfo("shm", fabric="efa-direct")
    monkeypatch.setenv("FABRICLAB_FABRIC", "efa-direct")
    with pytest.raises(fi.UsageError, match="FABRICLAB_FABRIC"):
        nics.NicSet("shm", 1)
    monkeypatch.setenv("FABRICLAB_FABRIC", "shm")
    with nics.NicSet("shm", 2) as nicset:
        assert "fabric shm" in nicset.describe()


def test_the_fabric_option_reaches_the_peers_a_command_starts(monkeypatch):
    monkeypatch.setenv("FABRICLAB_FABRIC", "")  # so that the test's end restores the environment
    parser = cli.argparse.ArgumentParser()
    cli.add_fabric_options(parser)
    assert parser.parse_args(["--fabric", "efa"]).fabric == "efa"
    assert cli.os.environ["FABRICLAB_FABRIC"] == "efa"  # inherited by bench's server, so both sides agree
    done = subprocess.run([sys.executable, "-m", "fabriclab.rdma_write", "serve", "--fabric", "nosuch", "--provider",
                           "shm"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no fabric 'nosuch'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("rc, direct, words", [(0, True, "GPUDirect"), (-fi.lib.FI_EOPNOTSUPP, False, "no GPUDirect"),
                                               (-fi.lib.FI_EINVAL, False, "no CUDA"), (-92, None, "does not answer")])
def test_the_cuda_api_answer_decides_direct_or_staged(rc, direct, words):
    assert fi.gpu_direct_verdict("efa", rc)[0] is direct
    assert words in fi.gpu_direct_verdict("efa", rc)[1]


def test_endpoints_without_device_memory_are_not_asked(fabric):
    with fi.open_endpoint(*fabric) as stack:
        assert not stack.info.hmem and stack.ep.gpu_direct is None


def test_error_entries_are_read_with_no_stale_error_data(fabric):
    """fi_cq_readerr gets err_data_size 0 whatever the previous entry left: a provider that fills error data
    of its own (efa) would otherwise write through a stale pointer and size. (shm and tcp reset the size
    themselves, so here the entry is checked as handed over, and a poisoned one still reads cleanly.)"""
    entry = fi.ffi.new("struct fi_cq_err_entry *")
    stale = fi.ffi.new("char[]", 8)
    entry.err_data, entry.err_data_size = stale, 4096
    assert fi.fresh_error_entry(entry) == entry and entry.err_data == fi.ffi.NULL and entry.err_data_size == 0
    with fi.open_endpoint(*fabric) as rx, fi.open_endpoint(*fabric) as tx:
        rx_mr, tx_mr = rx.register(np.zeros(16, np.uint8)), tx.register(np.ones(4096, np.uint8))
        rx.cq._err.err_data, rx.cq._err.err_data_size = stale, 4096
        rx.ep.post_recv(rx_mr, 0, 16, token="small-recv")
        dest = tx.av.insert(rx.ep.address())
        with pytest.raises(fi.FabricError, match="completion"):
            posted = False
            for _ in range(200000):
                posted = posted or tx.ep.try_post_send(tx_mr, 0, 4096, dest, token="big-send")
                tx.cq.poll()
                rx.cq.poll()


def test_the_library_says_which_path_a_peer_takes(fabric):
    from fabriclab import Engine
    with Engine(fabric[0], domains=fabric[1], pin=False) as a, Engine(fabric[0], domains=fabric[1], pin=False) as b:
        peer = a.connect(b.address)
        want = "shared memory (the shm provider)" if fabric[0] == "shm" else "the NICs"
        assert peer.transport == want and want in repr(peer)


def test_efa_peers_on_one_host_take_shared_memory_unless_switched_off(monkeypatch):
    switch = nics.SAME_HOST_SHM_SWITCHES["efa"]
    monkeypatch.delenv(switch, raising=False)
    assert nics.same_host_path("efa", same_host=True).startswith("shared memory") and f"{switch}=0" in \
        nics.same_host_path("efa", same_host=True)
    assert nics.same_host_path("efa", same_host=False) == "the NICs"
    assert nics.measure_the_nics() == f"{switch}=0" and nics.same_host_path("efa", same_host=True) == "the NICs"
    monkeypatch.setenv(switch, "1")  # the user's own setting is kept
    assert nics.measure_the_nics() == "" and nics.same_host_path("efa", same_host=True).startswith("shared memory")


def test_benchmarks_and_lessons_measure_the_nics():
    code = ("import os, fabriclab.course, fabriclab.tools.bench as b; import argparse; "
            "print(os.environ.get('FI_EFA_ENABLE_SHM_TRANSFER'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "FI_EFA_ENABLE_SHM_TRANSFER"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.strip() == "0", done.stderr
