"""fi objects across fork() and garbage collection (issue 12, finding 6): a child never uses or closes
what its parent opened; what nobody refers to any more is closed. Real processes, real libfabric."""
import gc
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from fabriclab import fi
from helpers import LINE_TIMEOUT, Child, regions_of

HELPER = os.path.join(os.path.dirname(__file__), "forked_endpoint.py")

pytestmark = pytest.mark.skipif("shm" not in fi.available_providers(), reason="needs libfabric's shm provider")


def test_a_forked_child_neither_uses_nor_closes_the_parents_endpoint():
    server = Child([sys.executable, "-m", "fabriclab.unidirectional", "serve", "--provider", "shm"])
    try:
        address = server.line(LINE_TIMEOUT, "the server's address")
        server.line(LINE_TIMEOUT, "serving on ...")
        run = subprocess.run([sys.executable, HELPER, address], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr  # it stops at the first use that is not refused
        lines = run.stdout.splitlines()
        refused = {line.split(" ", 1)[1] for line in lines if line.startswith("refused ")}
        assert {"ep.address", "ep.try_post_send", "cq.poll", "register", "new CompletionQueue"} <= refused
        # the child exited cleanly, the parent's region is still there, and a send through it completed
        assert [line for line in lines if not line.startswith("refused ")] == ["child exited 0", "regions 1", "sent"]
        assert server.line(LINE_TIMEOUT, "what the server received").startswith("received 10 bytes")
        assert server.poll() is None
    finally:
        server.signal(signal.SIGTERM)
        server.wait()


def test_a_dropped_tree_is_closed_when_collected():
    before = set(regions_of(os.getpid()))
    stack = fi.open_endpoint("shm")
    assert len(set(regions_of(os.getpid())) - before) == 1
    del stack  # no close(): the endpoint, and its region in /dev/shm, go with the last reference
    gc.collect()
    assert set(regions_of(os.getpid())) == before


def test_a_dropped_memory_region_is_deregistered_when_collected():
    # Keys are fabriclab's choice unless FI_MR_PROV_KEY: registering a second region under a key in use
    # fails in libfabric, so reusing the key proves the dropped region was deregistered.
    with fi.open_endpoint("shm") as stack:
        if stack.info.prov_key:
            pytest.skip("the provider chooses the keys here")
        buffer = np.zeros(4096, np.uint8)
        first = stack.register(buffer)
        key = first.key
        stack.domain._next_key = iter([key])
        with pytest.raises(fi.FabricError, match="fi_mr_regattr"):
            stack.register(buffer)
        del first
        gc.collect()
        stack.domain._next_key = iter([key])
        assert stack.register(buffer).key == key
        assert [type(c).__name__ for c in stack.domain.children] == ["CompletionQueue", "AddressVector", "Endpoint"]


def test_a_tree_in_a_reference_cycle_is_closed_by_the_collector():
    """Cyclic garbage is finalized in no particular order: a parent may go before its children, and then
    closes them itself, newest first."""
    before = set(regions_of(os.getpid()))
    stack = fi.open_endpoint("shm")
    mr = stack.register(np.zeros(64, np.uint8))
    mr.stack = stack.ep.stack = stack  # cycles through the memory region and the endpoint
    del stack, mr
    gc.collect()
    assert set(regions_of(os.getpid())) == before


def test_closed_and_dropped_children_after_close():
    stack = fi.open_endpoint("shm")
    stack.register(np.zeros(64, np.uint8))  # dropped at once: deregistered then
    keep = stack.register(np.zeros(64, np.uint8))
    stack.close()
    assert keep.closed and stack.ep.closed and not keep.inherited
    with pytest.raises(fi.UsageError, match="MemoryRegion is closed"):
        keep.remote()
    with pytest.raises(fi.UsageError, match="cannot create a CompletionQueue here: Domain is closed"):
        fi.CompletionQueue(stack.domain)


def region_names():
    return {os.path.basename(p) for p in regions_of(os.getpid())}


def test_an_endpoint_held_by_another_tree_of_this_process_closes_in_libfabric_after_it():
    """shm maps an endpoint of the same process into a peer's address vector as the endpoint's own mapping,
    unmapped at its fi_close: the target closed first stays open in libfabric (closed for Python) until the
    tree holding its address closes; a writer closed first, until the endpoints it wrote to close, unless
    declared idle. Cycles close too."""
    before = region_names()
    writer, target = fi.open_endpoint("shm"), fi.open_endpoint("shm")
    mine = region_names() - before
    writer.av.insert(target.ep.address())
    target.close()
    assert target.closed and region_names() - before == mine  # closed for Python, still open in libfabric
    with pytest.raises(fi.UsageError):
        target.ep.address()
    writer.close()
    assert not region_names() - before

    writer, target = fi.open_endpoint("shm"), fi.open_endpoint("shm")
    writer.av.insert(target.ep.address())
    writer.close()  # it may have posted to the target: the target could still answer into its region
    assert len(region_names() - before) == 2
    target.close()
    assert not region_names() - before

    writer, target = fi.open_endpoint("shm"), fi.open_endpoint("shm")
    writer.av.insert(target.ep.address())
    writer.ep.declare_idle()  # nothing of it left for the target to answer
    writer.close()
    assert len(region_names() - before) == 1
    target.close()

    a, b = fi.open_endpoint("shm"), fi.open_endpoint("shm")
    a.av.insert(b.ep.address())
    b.av.insert(a.ep.address())
    a.close()
    b.close()
    assert not region_names() - before
