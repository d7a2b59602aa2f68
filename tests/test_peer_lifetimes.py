"""Peers coming and going for the life of a service (issue 31, findings 3 and 4): a staged target serves writers
that each run a fresh Engine, a writer reaches targets that restart, and lane requests naming made-up control
addresses take no lasting place, because address-vector entries are removed once their peer is gone or no longer
needed (shm's address vectors hold 256 peers). Every peer is a real engine, every forged request a real message;
the counts pass shm's 256 (300; 100 where the vector takes thousands), each test well under a minute."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from fabriclab import Engine, bootstrap, control, fi
from fabriclab.wire import decode_address, decode_region
from helpers import Child, PeerProcess, python
from test_landing_hostile import forging_peer, honest_write, stop

HERE = os.path.dirname(os.path.abspath(__file__))
WRITER = os.path.join(HERE, "hostile_writer.py")
TARGETS = os.path.join(HERE, "engines_in_turn.py")
PAGE = 65536


def coming_and_going(fabric):
    """How many peers come and go in a test: past the address vector's limit where the provider has a small
    one (shm: 256 peers, so 300), else 100 (six times control.PEERS_KEPT: idle entries are seen to go)."""
    most = int(fi.getinfo(fabric[0], fabric[1])[0].ptr.domain_attr.ep_cnt)
    return most + 44 if 0 < most <= 1024 else 100


def fresh_writers(fabric, target, count, imm):
    """tests/hostile_writer.py: ``count`` writers in turn, each a fresh Engine writing one page into
    ``target`` (a PeerProcess); its last line."""
    packed = bootstrap.pack(target.address, target.descriptor).hex()
    done = subprocess.run([sys.executable, WRITER, fabric[0], fabric[1] or "-", packed, str(count), str(imm),
                           "--fresh"], capture_output=True, text=True, timeout=240)
    return (done.stdout.strip().splitlines() or [done.stderr[-2000:]])[-1]


def control_stats(target):
    return json.loads(target.ask("stats staging"))


def settled(target, most, timeout=20.0):
    """The staged target's staging stats once it holds at most ``most`` control peers (idle ones go after
    control.QUIET_S), or as they are at ``timeout``."""
    deadline = time.monotonic() + timeout
    stats = control_stats(target)
    while stats["control_peers"] > most and time.monotonic() < deadline:
        time.sleep(0.5)
        stats = control_stats(target)
    return stats


def peers_regions_mapped(pid):
    """The shm regions of other processes that process ``pid`` maps (its peers' endpoints, live or gone)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if "/dev/shm/" in line
                and not line.split(maxsplit=5)[5].startswith(f"/dev/shm/{pid}:")} - {""}


def test_a_staged_target_serves_writers_coming_and_going(fabric):
    """Writer 256 and every later one timed out on shm: the target's control channel inserted each writer's
    address and never removed one. Now idle ones are removed: the target holds at most control.PEERS_KEPT.
    On shm each writer's NIC endpoint also had the target map its region (~4 MiB of memory, held for good:
    the soak ran out of memory at 5,400 writers); now the target enters its writers' NICs (REQUEST names
    them) and removes each once its endpoint is gone, so it maps only the regions of a few recent writers."""
    count = coming_and_going(fabric)
    with PeerProcess(fabric, 16 * PAGE, "--staged-host") as target:
        assert fresh_writers(fabric, target, count, 5) == f"wrote {count}"
        stats = settled(target, control.PEERS_KEPT)
        # (on tcp a later writer's control endpoint may get an earlier one's port: the same entry serves it)
        assert stats["control_peers"] <= control.PEERS_KEPT, stats
        assert stats["control_peers_removed"] >= count - 2 * control.PEERS_KEPT, stats
        assert target.ask("count 5") == str(16 * PAGE)  # call i wrote page i % 16
        if fabric[0] == "shm":
            deadline = time.monotonic() + 3 * control.QUIET_S  # gone writers' entries go at the next tidy
            while len(peers_regions_mapped(target.proc.pid)) > 2 * control.PEERS_KEPT and time.monotonic() < deadline:
                time.sleep(0.5)
            mapped = peers_regions_mapped(target.proc.pid)
            entries = json.loads(target.ask("stats peer_entries"))
            assert len(mapped) <= 2 * control.PEERS_KEPT, (len(mapped), sorted(mapped)[:5], entries)
            assert entries["writers_reaching"] <= 2 and entries["removed"] >= count - 2, entries


def test_lane_requests_naming_made_up_addresses_take_no_lasting_place(fabric):
    """300 lane requests (with the region's key), each naming a made-up control address, filled shm's address
    vector for good: three honest writers then timed out. Now shm refuses a name with no endpoint behind it,
    and where one is taken (tcp: a loopback port nobody listens on) it goes once its messages fail."""
    count = coming_and_going(fabric)
    with PeerProcess(fabric, 16 * PAGE, "--staged-host") as target:
        landing = decode_region(target.descriptor).landing
        forger = forging_peer(fabric, target.descriptor, 3000, "requests", str(count),
                              str(decode_region(target.descriptor).region_id), str(landing.key))
        try:
            assert forger.line(60, "the forger's requests sent") == "sent"
            assert fresh_writers(fabric, target, 3, 6) == "wrote 3"
            stats = settled(target, 3)
        finally:
            stop(forger)
        assert stats["control_peers"] <= 3, stats
        if fabric[0] == "shm":
            assert stats["bad_control_messages"] >= count, stats
        else:
            assert stats["control_peers_removed"] >= count, stats


def test_nic_addresses_a_request_names_go_only_once_their_endpoint_is_gone(fabric):
    """A REQUEST names its writer's NICs, and the target enters them where its provider maps every writer
    (shm): so a forger may name someone else's. An entry goes only once its endpoint is gone, whoever named
    it: a bystander engine whose NICs forged requests named (the forger then ending) writes 64 KiB pages (past
    shm's inject size: the target reads the bystander's region) byte-exact, made-up NIC names are never
    entered, and once the bystander closes its entries go."""
    with PeerProcess(fabric, 16 * PAGE, "--staged-host") as target:
        region, landing = decode_region(target.descriptor).region_id, decode_region(target.descriptor).landing
        with writer_engine(fabric) as bystander:
            slots = bystander._service.nics.slots
            nics = ",".join(slot.ep.address().to_bytes().hex() for slot in slots)
            forger = forging_peer(fabric, target.descriptor, 3000, "requests", "20", str(region), str(landing.key),
                                  nics)
            try:
                assert forger.line(60, "the forger's requests sent") == "sent"
            finally:
                stop(forger)
            expected = len(slots) if fabric[0] == "shm" else 0
            deadline = time.monotonic() + 3 * control.QUIET_S  # the forger's entry goes at a tidy of the target's
            entries = json.loads(target.ask("stats peer_entries"))
            while entries["writers_reaching"] != expected and time.monotonic() < deadline:
                time.sleep(0.5)
                entries = json.loads(target.ask("stats peer_entries"))
            assert entries["writers_reaching"] == expected, entries
            for value in range(8, 12):
                assert honest_write(bystander, target.descriptor, target.address, value, list(range(16)),
                                    imm=value).pages == 16
                assert target.ask(f"count {value}") == str(16 * PAGE)
        deadline = time.monotonic() + 3 * control.QUIET_S
        while json.loads(target.ask("stats peer_entries"))["writers_reaching"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert json.loads(target.ask("stats peer_entries"))["writers_reaching"] == 0


def in_turn(fabric, count):
    """tests/engines_in_turn.py: ``count`` target engines, one after another."""
    return Child(python(TARGETS, fabric[0], fabric[1] or "-", count))


def writer_engine(fabric):
    return Engine(fabric[0], domains=fabric[1], nics=1, pin=False, gpu=False, timeout=10)


def test_a_writer_reaches_targets_coming_and_going(fabric):
    """On shm, connecting to target 256 raised 'fi_av_insert rejected the address': each connect inserted the
    target's address, and none was ever removed. Now a Peer closed, or dropped, gives its entries back, and a
    target connected again after its Peer closed is written to as before."""
    count = coming_and_going(fabric)
    with writer_engine(fabric) as writer, in_turn(fabric, count) as targets:
        source = writer.register(np.arange(PAGE, dtype=np.uint64).view(np.uint8)[:PAGE])
        for i in range(count):
            address, descriptor = bootstrap.unpack(bytes.fromhex(targets.line()))
            peer = writer.connect(address)
            assert peer.write_pages(source, [0], descriptor, [0], PAGE, imm=i).result(10).pages == 1
            if i % 2:  # closed, its entry goes; the same target connected again takes one anew (on shm, the slot
                peer.close()  # just freed, whose handshake is made again: a 64 KiB write crashed the target)
                peer = writer.connect(address)
                assert peer.write_pages(source, [0], descriptor, [0], PAGE, imm=i).result(10).pages == 1
            del peer  # dropped unclosed
            assert targets.ask(f"expect {i}") == "landed"
        assert targets.line() == "done"
        entries = writer.stats()["peer_entries"]
        assert entries["entries"] <= 1 and entries["removed"] >= count - 1, entries


def test_an_address_vector_full_of_open_peers_says_what_to_do():
    """shm takes 256 peers per address vector: a writer keeping a Peer open to each of 256 targets cannot
    connect a 257th, and is told why and what to do (the error named no limit); one Peer closed, it can."""
    fabric = ("shm", None)
    most = 256
    with writer_engine(fabric) as writer, in_turn(fabric, most + 1) as targets:
        peers = []
        for i in range(most):
            peers.append(writer.connect(bootstrap.unpack(bytes.fromhex(targets.line()))[0]))
            targets.send("next")
        address = bootstrap.unpack(bytes.fromhex(targets.line()))[0]
        with pytest.raises(fi.AddressVectorFull, match=f"holds {most} peers, the most it takes \\(shm: {most}\\).*"
                                                         "close the Peers you no longer write to"):
            writer.connect(address)
        peers.pop().close()
        assert writer.connect(address).id == decode_address(address)[0]
        targets.send("next")
        assert targets.line() == "done"
