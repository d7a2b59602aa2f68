"""The modeled p5 behaves like EFA where an engine can go wrong (issue 22, docs/model.md): FI_MORE holds the
doorbell, so a forgotten flush hangs here as on a p5."""
import time

import numpy as np
import pytest

import test_api
import test_engine
from conftest import shared_target
from test_sim import pair, pump, run_python  # noqa: F401 (pair: the fixture)


def test_fi_more_holds_writes_until_a_post_without_it(pair):
    a, b, to_b, _ = pair
    src, dst = a.register(np.ones(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
    for i in range(3):
        assert a.ep.try_post_write(src, 0, 64, to_b, dst.remote(), 64 * i, ("more", i), data=i, more=True)
    # many round trips of the model (2 us each way) pass: nothing leaves, nothing completes on either side
    assert pump([a, b], 1, timeout=0.2) == []
    assert a.ep.try_post_write(src, 0, 64, to_b, dst.remote(), 192, "flush", data=3)
    got = pump([a, b], 8)
    assert sorted(str(c.token) for c in got if c.token is not None) == ["('more', 0)", "('more', 1)",
                                                                         "('more', 2)", "flush"]
    assert sorted(c.data for c in got if c.has_data) == [0, 1, 2, 3]


def test_fi_more_run_never_flushed_never_leaves(pair):
    """The engine's flush rule matters: a run of FI_MORE writes that no write without it follows never completes
    (a send without FI_MORE rings the same doorbell)."""
    a, b, to_b, _ = pair
    src, dst = a.register(np.ones(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
    assert a.ep.try_post_write(src, 0, 4096, to_b, dst.remote(), 0, "held", data=7, more=True)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert not a.cq.poll() and not b.cq.poll()
    b.ep.post_recv(dst, 0, 64, "recv")
    a.ep.post_send(src, 0, 64, to_b, "send")
    got = pump([a, b], 4)
    assert sorted(str(c.token) for c in got) == ["None", "held", "recv", "send"]


SIM = ("sim", None)
sim_target = shared_target("fabriclab.multi_nic", "--timeout", "10", fabrics=[SIM])


def test_the_engine_ends_every_fi_more_run_on_sim(sim_target):
    """The stages' and the Engine's flush rule, where a run left open really stalls: test_engine's and
    test_api's FI_MORE checks, run on the model (their `fabric` fixture covers shm and tcp only)."""
    test_engine.test_fi_more_runs_always_end_without_fi_more(sim_target)
    test_api.test_a_write_refused_right_after_an_fi_more_run_still_ends_the_run(SIM)


FIRST_CONTACT = """
import time
import numpy as np
from fabriclab import fi
a, b = (fi.EndpointStack(fi.getinfo('sim', nic)[0]) for nic in ('rdmap16s0-rdm', 'rdmap17s0-rdm'))
to_b = a.av.insert(b.ep.address())
src, dst = a.register(np.ones(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
clock = a.cq.modeled_clock() or time.monotonic_ns  # the model's time where it has one
def timed_write(ep, data):
    start = clock()
    ep.post_write(src, 0, 64, to_b, dst.remote(), 0, 'w', data=data)
    got = []
    while len(got) < 2:
        got += a.cq.poll() + b.cq.poll()
    return (clock() - start) / 1e9
first, second = timed_write(a.ep, 1), timed_write(a.ep, 2)
fresh = fi.Endpoint(a.domain, a.cq, a.av)
print(first, second, timed_write(fresh, 3))
fresh.close()
"""


def test_first_write_to_a_new_peer_waits_for_a_handshake_round_trip():
    """As efa RDM handshakes with a new peer: the first write of an endpoint pair leaves two latencies late
    and completes after four (handshake there and back, the write, its acknowledgement); the next one after
    two; a fresh endpoint meets the peer anew. Lower bounds only, with a latency long enough to read them."""
    latency = 0.05
    out = run_python(FIRST_CONTACT, FABRICLAB_PROVIDER="sim", FABRICLAB_SIM_LATENCY_US=str(latency * 1e6))
    assert out.returncode == 0, out.stderr
    first, second, fresh = map(float, out.stdout.split())
    assert first >= 4 * latency and fresh >= 4 * latency
    assert second >= 2 * latency


DISORDER = """
import time
import numpy as np
from fabriclab import fi
a, b, c, d = (fi.EndpointStack(fi.getinfo('sim', f'rdmap{16 + i}s0-rdm')[0]) for i in range(4))
big = 8 << 20
src = a.register(np.ones(big, dtype=np.uint8))
dst_b, dst_c = b.register(np.zeros(big, dtype=np.uint8)), c.register(np.zeros(64, dtype=np.uint8))
from_d = d.register(np.ones(big, dtype=np.uint8))
d.ep.post_write(from_d, 0, big, d.av.insert(b.ep.address()), dst_b.remote(), 0, 'd->b')
time.sleep(0.001)  # past d's handshake with b: its write leaves at d's next poll (nothing runs between calls)
d.cq.poll()
a.ep.post_write(src, 0, 64, a.av.insert(b.ep.address()), dst_b.remote(), 0, 'a->b')
a.ep.post_write(src, 0, 64, a.av.insert(c.ep.address()), dst_c.remote(), 0, 'a->c')
order = []
while len(order) < 2:
    order += [done.token for done in a.cq.poll()]
    b.cq.poll(), c.cq.poll(), d.cq.poll()
print(*order)
"""


def test_local_completions_follow_the_wire_not_posting_order():
    """No ordering promise, as EFA reports FI_ORDER_NONE: a's write to NIC b waits on b's receive line behind
    d's 8 MiB (67 ms at a 1 Gbps line, long enough for Python to post behind it), its next write, to the idle
    NIC c, does not, and completes first. With FABRICLAB_SIM_ORDERED=1 (for teaching) they come in posting
    order."""
    for env, order in (({}, "a->c a->b"), ({"FABRICLAB_SIM_ORDERED": "1"}, "a->b a->c")):
        out = run_python(DISORDER, FABRICLAB_PROVIDER="sim", FABRICLAB_SIM_GBPS="1", **env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == order.split(), env


@pytest.mark.parametrize("case", test_engine.CASES, ids=[f"{c[0].stage}-{i}" for i, c in enumerate(test_engine.CASES)])
def test_every_stage_lands_every_page_once_with_completions_out_of_order(sim_target, case):
    """Chapters 9-15's stages and the engine on the model as it is by default (no ordering promise): test_engine's
    correctness cases, whose `fabric` fixture covers shm and tcp only."""
    test_engine.test_every_page_lands_exactly_once(sim_target, *case)

