"""fabriclab.topology: sysfs reading, NIC grouping and core proposals against fake sysfs trees, the recorded
p5.48xlarge layout, the JSON round-trip and the ``topo`` command."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from fabriclab import topology as tp
from fabriclab.course import figures
from fabriclab.topology import Gpu, Group, Nic, NumaNode, PciDevice, Topology

REPO = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ fake sysfs trees


def write_sysfs(root: pathlib.Path, pci: dict, numa: list, *, net: dict | None = None,
                infiniband: dict | None = None, numa_dirs: bool = True) -> pathlib.Path:
    """Render PCI devices and NUMA nodes as the sysfs files fabriclab reads, below ``root``.

    ``pci`` maps addresses to PciDevice (numa_node None is written as -1); ``numa`` is a list of NumaNode
    whose CPUs not in ``cores`` are the cores' hyperthread siblings, in order. ``net`` and ``infiniband``
    map interface names to the PCI address behind them."""
    sys_dir = root / "sys"
    devices = sys_dir / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    for addr, dev in pci.items():
        rel = pathlib.Path("devices", dev.host_bridge, *dev.bridges, addr)
        target = sys_dir / rel
        target.mkdir(parents=True, exist_ok=True)
        (target / "numa_node").write_text(f"{-1 if dev.numa_node is None else dev.numa_node}\n")
        (target / "local_cpulist").write_text(tp.format_cpulist(dev.local_cpus) + "\n")
        (devices / addr).symlink_to(pathlib.Path("..", "..", "..", rel))
    for cls, names in (("net", net or {}), ("infiniband", infiniband or {})):
        for name, addr in names.items():
            d = sys_dir / "class" / cls / name
            d.mkdir(parents=True, exist_ok=True)
            (d / "device").symlink_to(os.path.relpath((devices / addr).resolve(), d))
    cpu_dir = sys_dir / "devices" / "system" / "cpu"
    cpu_dir.mkdir(parents=True, exist_ok=True)
    every = sorted(c for n in numa for c in n.cpus)
    (cpu_dir / "online").write_text(tp.format_cpulist(every) + "\n")
    for n in numa:
        if numa_dirs:
            node_dir = sys_dir / "devices" / "system" / "node" / f"node{n.node}"
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "cpulist").write_text(tp.format_cpulist(n.cpus) + "\n")
        extra = [c for c in n.cpus if c not in n.cores]
        siblings = {c: [c] for c in n.cores}
        for core, sib in zip(n.cores, extra):
            siblings[core].append(sib)
            siblings[sib] = siblings[core]
        for cpu, sibs in siblings.items():
            t = cpu_dir / f"cpu{cpu}" / "topology"
            t.mkdir(parents=True, exist_ok=True)
            (t / "thread_siblings_list").write_text(tp.format_cpulist(sibs) + "\n")
    return root


def dev(addr, node, cpus, host, *bridges):
    return PciDevice(addr, node, list(cpus), list(bridges), host)


# A two-socket box: node 0 = cores 0-7 (+16-23), node 1 = cores 8-15 (+24-31).
NODE0 = list(range(0, 8)) + list(range(16, 24))
NODE1 = list(range(8, 16)) + list(range(24, 32))
TWO_NUMA = [NumaNode(0, NODE0, list(range(0, 8))), NumaNode(1, NODE1, list(range(8, 16)))]
TWO_PCI = {
    # cuda:0 and nicA share a switch (PIX); nicB has its own root port on cuda:0's host bridge (PHB)
    "0000:03:00.0": dev("0000:03:00.0", 0, NODE0, "pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"),
    "0000:04:00.0": dev("0000:04:00.0", 0, NODE0, "pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0"),
    "0000:05:00.0": dev("0000:05:00.0", 0, NODE0, "pci0000:00", "0000:00:02.0"),
    # cuda:1 on another host bridge of node 0; nicE on a third one, as close to cuda:0 as to cuda:1 (NODE)
    "0000:41:00.0": dev("0000:41:00.0", 0, NODE0, "pci0000:40", "0000:40:01.0"),
    "0000:61:00.0": dev("0000:61:00.0", 0, NODE0, "pci0000:60", "0000:60:01.0"),
    # cuda:2 on node 1; nicD two switches away on the same host bridge (PXB); nicC on another host bridge
    "0000:83:00.0": dev("0000:83:00.0", 1, NODE1, "pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0"),
    "0000:86:00.0": dev("0000:86:00.0", 1, NODE1, "pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:04.0",
                        "0000:84:00.0", "0000:85:00.0"),
    "0000:c1:00.0": dev("0000:c1:00.0", 1, NODE1, "pci0000:c0", "0000:c0:01.0"),
}
TWO_GPUS = [Gpu(0, "GPU A", "0000:03:00.0"), Gpu(1, "GPU B", "0000:41:00.0"), Gpu(2, "GPU C", "0000:83:00.0")]
TWO_NICS = [Nic("nicA", "verbs;ofi_rxm", "0000:04:00.0"), Nic("nicB", "verbs;ofi_rxm", "0000:05:00.0"),
            Nic("nicC", "verbs;ofi_rxm", "0000:c1:00.0"), Nic("nicD", "verbs;ofi_rxm", "0000:86:00.0"),
            Nic("nicE", "verbs;ofi_rxm", "0000:61:00.0")]

# The GPU machine: one GPU at 00:06.0 straight on the host bridge, 16 cores, one NUMA node, sysfs says -1.
ONE_NUMA = [NumaNode(0, list(range(16)), list(range(16)))]
ONE_PCI = {"0000:00:06.0": dev("0000:00:06.0", None, range(16), "pci0000:00")}


@pytest.fixture(scope="module")
def p5():
    return Topology.load("p5.48xlarge")


@pytest.fixture
def p5_tree(tmp_path, p5):
    by_device = {n.device: n.pci for n in p5.nics}
    return write_sysfs(tmp_path, p5.pci, p5.numa_nodes, infiniband=by_device)


@pytest.fixture
def two_socket(tmp_path):
    return write_sysfs(tmp_path, TWO_PCI, TWO_NUMA)


@pytest.fixture
def gpu_box(tmp_path):
    return write_sysfs(tmp_path, ONE_PCI, ONE_NUMA)


# ---------------------------------------------------------------------------- the recorded p5


def test_recorded_p5_facts(p5):
    assert p5.source == "recorded" and p5.recorded and "recorded" in p5.title
    assert "p5.48xlarge" in tp.recorded_names()
    assert len(p5.gpus) == 8 and len(p5.nics) == 32 and p5.provider == "efa"
    assert [n.node for n in p5.numa_nodes] == [0, 1]
    assert [len(n.cores) for n in p5.numa_nodes] == [48, 48]
    assert all(n.link_speed_bps == 100_000_000_000 for n in p5.nics)
    assert sum(n.link_speed_bps for n in p5.nics) == 3_200_000_000_000
    # the article's table: GPU PCI bus, NUMA node, first and last EFA bus of each group
    table = [(0x53, 0, 79), (0x64, 0, 96), (0x75, 0, 113), (0x86, 0, 130),
             (0x97, 1, 147), (0xa8, 1, 164), (0xb9, 1, 181), (0xca, 1, 198)]
    for g, (bus, node, first) in zip(p5.groups, table):
        assert p5.gpu(g.gpu).pci == f"0000:{bus:02x}:00.0"
        assert g.numa_node == node and g.link == "PIX"
        assert g.nics == [f"rdmap{first + k}s0-rdm" for k in range(4)]
        assert [p5.nic(n).pci for n in g.nics] == [f"0000:{first + k:02x}:00.0" for k in range(4)]
    assert [g.cores for g in p5.groups] == [list(range(1, 12))] + [list(range(12 * i, 12 * i + 12)) for i in range(1, 8)]


def test_recorded_p5_groups_follow_from_its_data(p5):
    notes = []
    assert tp.plan_groups(p5.gpus, p5.nics, p5.pci, p5.numa_nodes, None, notes) == p5.groups
    assert notes == []
    assert p5.link(0, "rdmap79s0-rdm") == "PIX"
    assert p5.link(0, "rdmap96s0-rdm") == "NODE"  # cuda:1's switch, same socket
    assert p5.link(0, "rdmap147s0-rdm") == "SYS"  # the other socket


def test_p5_as_sysfs_tree(p5_tree, p5):
    found = Topology.discover(p5_tree, gpus=p5.gpus, nics=p5.nics, provider="efa", machine="fake p5")
    assert found.source == "live" and found.machine == "fake p5"
    assert found.groups == p5.groups
    assert found.pci == p5.pci
    assert found.numa_nodes == p5.numa_nodes
    assert found.notes == [] and found.allowed_cpus is None


def test_p5_nic_addresses_from_infiniband_class(p5_tree, p5):
    """fi_getinfo may leave the PCI address out; the RDMA device's sysfs link gives it back."""
    bare = [Nic(n.domain, "efa", None, None, None) for n in p5.nics]
    found = Topology.discover(p5_tree, gpus=p5.gpus, nics=bare)
    assert [n.pci for n in found.nics] == [n.pci for n in p5.nics]
    assert found.groups == p5.groups


def test_p5_allowed_cpus_restrict_proposals(p5_tree, p5):
    found = Topology.discover(p5_tree, gpus=p5.gpus, nics=p5.nics, allowed_cpus=range(0, 24))
    assert found.allowed_cpus == list(range(24))
    cores = {g.gpu: g.cores for g in found.groups}
    assert cores[0] == list(range(1, 6)) and cores[3] == list(range(18, 24))
    assert cores[4] == [] and cores[7] == []
    assert any("0 usable physical cores" in n for n in found.notes)


# ----------------------------------------------------------------------------- other machines


def test_two_sockets_nics_on_both(two_socket):
    topo = Topology.discover(two_socket, gpus=TWO_GPUS, nics=TWO_NICS)
    assert topo.provider == "verbs;ofi_rxm"
    assert topo.groups == [
        Group(0, ["nicA", "nicB"], 0, [1, 2, 3], "PHB"),
        Group(1, ["nicE"], 0, [4, 5, 6, 7], "NODE"),  # a tie between cuda:0 and cuda:1: the emptier one
        Group(2, ["nicC", "nicD"], 1, list(range(8, 16)), "NODE"),
    ]
    assert [topo.link(0, n) for n in ("nicA", "nicB", "nicC", "nicD", "nicE")] == ["PIX", "PHB", "SYS", "SYS", "NODE"]
    assert [topo.link(2, n) for n in ("nicC", "nicD")] == ["NODE", "PXB"]
    assert topo.numa_nodes == TWO_NUMA


def test_two_sockets_without_gpu(two_socket):
    topo = Topology.discover(two_socket, gpus=[], nics=TWO_NICS)
    assert topo.groups == [Group(None, ["nicA", "nicB", "nicE"], 0, list(range(1, 8)), None),
                           Group(None, ["nicC", "nicD"], 1, list(range(8, 16)), None)]
    assert any("no GPU" in n for n in topo.notes)


def test_more_groups_than_cores(tmp_path):
    numa = [NumaNode(0, [0, 1], [0, 1])]
    pci = {f"0000:0{i}:00.0": dev(f"0000:0{i}:00.0", 0, [0, 1], "pci0000:00", f"0000:00:0{i}.0") for i in range(1, 4)}
    root = write_sysfs(tmp_path, pci, numa)
    gpus = [Gpu(i, "g", f"0000:0{i + 1}:00.0") for i in range(3)]
    topo = Topology.discover(root, gpus=gpus, nics=[])
    assert [g.cores for g in topo.groups] == [[0], [1], [0]]
    assert [g.nics for g in topo.groups] == [[], [], []]
    assert any("share cores" in n for n in topo.notes)


def test_gpu_machine_with_shm(gpu_box):
    """One GPU, one NUMA node that sysfs calls -1, and a NIC with no PCI address: one group."""
    topo = Topology.discover(gpu_box, gpus=[Gpu(0, "NVIDIA H100 80GB HBM3", "00000000:00:06.0")],
                             nics=[Nic("shm", "shm")])
    assert topo.gpus[0].pci == "0000:00:06.0"
    assert topo.pci["0000:00:06.0"].numa_node == 0  # inferred: the only node
    assert topo.groups == [Group(0, ["shm"], 0, list(range(1, 16)), "?")]
    assert any("no NIC here has a known place" in n for n in topo.notes)
    table = tp.format_table(topo)
    assert "cuda:0" in table and "shm" in table and "no NIC here has a known place" in table


def test_tcp_veths_dealt_over_gpus(tmp_path):
    pci = {"0000:00:06.0": dev("0000:00:06.0", None, range(16), "pci0000:00"),
           "0000:00:07.0": dev("0000:00:07.0", None, range(16), "pci0000:00")}
    root = write_sysfs(tmp_path, pci, ONE_NUMA)
    gpus = [Gpu(0, "g", "0000:00:06.0"), Gpu(1, "g", "0000:00:07.0")]
    topo = Topology.discover(root, gpus=gpus, nics=["veth0", "veth1", "lo"], provider="tcp;ofi_rxm")
    assert topo.groups == [Group(0, ["veth0", "lo"], 0, list(range(1, 8)), "?"),
                           Group(1, ["veth1"], 0, list(range(8, 16)), "?")]
    assert all(n.pci is None and n.provider == "tcp;ofi_rxm" for n in topo.nics)


def test_no_gpu_no_pci_nic(tmp_path):
    root = write_sysfs(tmp_path, {}, ONE_NUMA)
    topo = Topology.discover(root, gpus=[], nics=[Nic("shm", "shm")])
    assert topo.groups == [Group(None, ["shm"], 0, list(range(1, 16)), None)]
    assert Topology.discover(root, gpus=[], nics=[]).groups == []


def test_tcp_interface_with_a_pci_device(tmp_path):
    """A tcp domain names a network interface; where that interface is a PCI NIC, it gets its address."""
    root = write_sysfs(tmp_path, ONE_PCI, ONE_NUMA)
    # the interface is a virtio device on PCI function 00:03.0, as on a VM
    nic_dir = root / "sys" / "devices" / "pci0000:00" / "0000:00:03.0"
    (nic_dir / "virtio2").mkdir(parents=True)
    (nic_dir / "numa_node").write_text("-1\n")
    (root / "sys" / "bus" / "pci" / "devices" / "0000:00:03.0").symlink_to("../../../devices/pci0000:00/0000:00:03.0")
    (root / "sys" / "class" / "net" / "eth0").mkdir(parents=True)
    (root / "sys" / "class" / "net" / "eth0" / "device").symlink_to("../../../devices/pci0000:00/0000:00:03.0/virtio2")
    topo = Topology.discover(root, gpus=[Gpu(0, "g", "0000:00:06.0")], nics=["eth0", "lo"], provider="tcp;ofi_rxm")
    assert topo.nic("eth0").pci == "0000:00:03.0" and topo.nic("lo").pci is None
    assert topo.link(0, "eth0") == "PHB"
    assert topo.groups == [Group(0, ["eth0", "lo"], 0, list(range(1, 16)), "?")]


# ------------------------------------------------------------------------------ malformed sysfs


def test_malformed_sysfs_never_crashes(two_socket):
    devs = two_socket / "sys" / "devices"
    gpu0 = devs / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0" / "0000:02:00.0" / "0000:03:00.0"
    (gpu0 / "numa_node").write_text("-1\n")  # unknown node, local CPUs within node 0
    nic_b = devs / "pci0000:00" / "0000:00:02.0" / "0000:05:00.0"
    (nic_b / "numa_node").unlink()
    (nic_b / "numa_node").mkdir()  # unreadable as a file, even for root
    (nic_b / "local_cpulist").write_text("1-x,\n")
    cuda2 = devs / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0" / "0000:82:00.0" / "0000:83:00.0"
    (cuda2 / "numa_node").write_text("banana\n")
    (cuda2 / "local_cpulist").write_text("0-31\n")  # spans both nodes: no guess
    nic_d = cuda2.parent.parent / "0000:82:04.0" / "0000:84:00.0" / "0000:85:00.0" / "0000:86:00.0"
    (nic_d / "numa_node").write_text("")
    (nic_d / "local_cpulist").write_text("0-31\n")
    links = two_socket / "sys" / "bus" / "pci" / "devices"
    (links / "0000:c1:00.0").unlink()  # nicC: no link at all
    (links / "0000:61:00.0").unlink()
    (links / "0000:61:00.0").symlink_to("../../../devices/nowhere/0000:61:00.0")  # nicE: dangling link
    (two_socket / "sys" / "devices" / "system" / "cpu" / "cpu3" / "topology" / "thread_siblings_list").unlink()
    nics = TWO_NICS + [Nic("shm", "shm", None)]
    topo = Topology.discover(two_socket, gpus=TWO_GPUS + [Gpu(3, "lost", "0000:ee:00.0")], nics=nics)

    assert topo.pci["0000:03:00.0"].numa_node == 0  # from its local CPUs
    assert topo.pci["0000:05:00.0"].numa_node is None and topo.pci["0000:05:00.0"].local_cpus == []
    assert topo.pci["0000:83:00.0"].numa_node is None
    for missing in ("0000:c1:00.0", "0000:61:00.0", "0000:ee:00.0"):
        assert topo.pci[missing] == PciDevice(missing, None, [], [], None, found=False)
    assert topo.link(0, "nicB") == "PHB"  # same host bridge, whatever the NUMA files say
    assert topo.link(0, "nicC") == "?" and topo.link(3, "nicA") == "?"
    # placed NICs first (nicA PIX, nicB PHB, nicD PXB), then the ones nobody can place go to the emptiest
    assert topo.groups == [
        Group(0, ["nicA", "nicB"], 0, [1, 2, 3], "PHB"),
        Group(1, ["nicC", "shm"], 0, [4, 5, 6, 7], "?"),
        Group(2, ["nicD"], None, list(range(1, 8)), "PXB"),  # no readable node: cores drawn from every CPU
        Group(3, ["nicE"], None, list(range(8, 16)), "?"),
    ]
    assert tp.format_table(topo) and figures.pcie_tree(topo)


def test_empty_or_missing_sysfs(tmp_path):
    topo = Topology.discover(tmp_path / "nothing", gpus=[Gpu(0, "g", "0000:06:00.0")], nics=["shm"])
    assert topo.numa_nodes == [] and topo.groups == [Group(0, ["shm"], None, [], "?")]
    assert any("no NUMA nodes" in n for n in topo.notes)
    # CPUs but no node directories: one node, from cpu/online
    write_sysfs(tmp_path / "flat", {}, ONE_NUMA, numa_dirs=False)
    flat = Topology.discover(tmp_path / "flat", gpus=[], nics=["shm"])
    assert flat.numa_nodes == ONE_NUMA and flat.groups[0].cores == list(range(1, 16))


def test_pci_device_that_is_a_plain_directory(tmp_path):
    d = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:06:00.0"
    d.mkdir(parents=True)
    (d / "numa_node").write_text("0\n")
    got = tp.Sysfs(tmp_path).pci_device("0000:06:00.0")
    assert got.found and got.numa_node == 0 and got.bridges == [] and got.host_bridge is None


def test_parsing_helpers():
    assert tp.parse_cpulist("0-3,8, 10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert tp.parse_cpulist("") == [] and tp.parse_cpulist(None) == [] and tp.parse_cpulist("3-1") == []
    assert tp.parse_cpulist("x") == [] and tp.parse_cpulist("-1") == []
    assert tp.format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and tp.format_cpulist([]) == "-"
    assert tp.normalize_pci("00000000:06:00.0") == "0000:06:00.0"
    assert tp.normalize_pci("0000:4F:00.0") == "0000:4f:00.0"
    assert tp.normalize_pci("4f:00.1") == "0000:4f:00.1"
    assert tp.normalize_pci("10000:01:00.0") == "10000:01:00.0"
    assert tp.normalize_pci("virtio2") is None and tp.normalize_pci(None) is None


# -------------------------------------------------------------------------------- data and CLI


def test_json_round_trip(p5, two_socket, tmp_path):
    again = Topology.from_json(p5.to_json())
    assert again.to_dict() == p5.to_dict()
    assert again.groups == p5.groups and isinstance(again.groups[0], Group)
    topo = Topology.discover(two_socket, gpus=TWO_GPUS, nics=TWO_NICS)
    path = tmp_path / "box.json"
    path.write_text(topo.to_json())
    loaded = Topology.load(path)
    assert loaded.source == "recorded" and loaded.machine == "box"
    assert loaded.groups == topo.groups and loaded.pci == topo.pci and loaded.numa_nodes == topo.numa_nodes
    # groups left out are worked out again
    data = topo.to_dict()
    del data["groups"]
    assert Topology.from_dict(data).groups == topo.groups
    with pytest.raises(ValueError):
        Topology.from_dict({"format": "something/9", "gpus": [], "nics": []})
    with pytest.raises(FileNotFoundError, match="p5.48xlarge"):
        Topology.load("no-such-machine")


def test_drawing(p5, two_socket, tmp_path):
    fig = figures.pcie_tree(p5)
    assert "recorded" in fig.axes[0].get_title()
    fig.savefig(tmp_path / "p5.png")
    assert (tmp_path / "p5.png").stat().st_size > 10_000
    figures.pcie_tree(Topology.discover(two_socket, gpus=TWO_GPUS, nics=TWO_NICS + ["shm"]))
    figures.pcie_tree(Topology.discover(tmp_path / "nothing", gpus=[], nics=[]))


def test_cli_recorded(capsys, tmp_path):
    from fabriclab.__main__ import main
    assert main(["topo", "--recorded", "p5.48xlarge", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "recorded" and len(data["gpus"]) == 8 and len(data["nics"]) == 32
    assert data["groups"][0] == {"gpu": 0, "nics": ["rdmap79s0-rdm", "rdmap80s0-rdm", "rdmap81s0-rdm",
                                                    "rdmap82s0-rdm"],
                                 "numa_node": 0, "cores": list(range(1, 12)), "link": "PIX"}
    png = tmp_path / "p5.png"
    assert main(["topo", "--recorded", "p5.48xlarge", "--draw", str(png)]) == 0
    out = capsys.readouterr().out
    assert "p5.48xlarge (recorded)" in out and "rdmap79s0-rdm" in out and png.exists()


def test_cli_this_machine_json_is_loadable(tmp_path):
    """``python -m fabriclab topo --json`` here (shm or tcp NICs, no PCI NIC) prints a loadable layout."""
    run = subprocess.run([sys.executable, "-m", "fabriclab", "topo", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    topo = Topology.from_json(run.stdout)
    assert topo.source == "live" and topo.numa_nodes
    assert sum(len(g.nics) for g in topo.groups) == len(topo.nics)
    (tmp_path / "here.json").write_text(run.stdout)
    assert Topology.load(tmp_path / "here.json").recorded


def test_live_discovery_finds_the_gpus():
    """Runs everywhere; on a machine with CUDA it checks that each GPU is found in sysfs with a NUMA node."""
    from fabriclab import gpu
    topo = Topology.discover()
    assert len(topo.gpus) == len(gpu.devices())
    for g in topo.gpus:
        d = topo.pci[g.pci]
        assert d.found and d.numa_node is not None and d.host_bridge
        assert topo.group_for(g.index).cores
