"""The binding: discovery, the resource tree, errors, addresses — against the real libfabric."""
import gc

import numpy as np
import pytest

from fabriclab import fi
from conftest import PROVIDERS, available, open_fds


@pytest.fixture(params=PROVIDERS + [("sim", None)], ids=[p for p, _ in PROVIDERS] + ["sim"])
def fabric(request):
    """The binding's own tests run over the modeled NICs (provider sim) too."""
    return available(request.param)


def test_default_provider_is_available():
    assert fi.default_provider() in fi.available_providers()


def test_environment_picks_provider(monkeypatch):
    monkeypatch.setenv("FABRICLAB_PROVIDER", "tcp;ofi_rxm")
    assert fi.getinfo(domain="lo")[0].provider == "tcp;ofi_rxm"


def test_unknown_provider_lists_the_available_ones():
    with pytest.raises(fi.UsageError) as err:
        fi.getinfo("no-such-provider")
    assert "no-such-provider" in str(err.value)
    for name in fi.available_providers():
        assert name in str(err.value)


def test_unknown_domain_lists_the_domains():
    with pytest.raises(fi.UsageError, match="no domain 'nic99'.*lo"):
        fi.getinfo("tcp;ofi_rxm", "nic99")


def test_info_reports_what_the_provider_needs(fabric):
    info = fi.getinfo(*fabric)[0]
    assert info.provider == fabric[0]
    assert info.max_msg_size > 0 and info.cq_data_size >= 4
    assert set(info.mr_mode_names) <= {"FI_MR_LOCAL", "FI_MR_VIRT_ADDR", "FI_MR_ALLOCATED", "FI_MR_PROV_KEY",
                                       "FI_MR_ENDPOINT", "FI_MR_HMEM"}


def test_tree_closes_children_first_and_twice_is_harmless(fabric):
    stack = fi.open_endpoint(*fabric)
    buf = np.zeros(4096, np.uint8)
    mr = stack.register(buf)
    labels = [label.split()[0] for _, label in fi.describe_tree(stack.fabric)]
    assert labels == ["Fabric", "Domain", "CompletionQueue", "AddressVector", "Endpoint", "MemoryRegion"]
    stack.close()
    assert all(r.closed for r in (stack.fabric, stack.domain, stack.cq, stack.av, stack.ep, mr))
    stack.close()
    mr.close()
    with pytest.raises(fi.UsageError, match="closed"):
        stack.cq.poll()


def test_remote_region_follows_mr_mode(fabric):
    with fi.open_endpoint(*fabric) as stack:
        buf = np.zeros(100, np.uint8)
        mr = stack.register(buf)
        remote = mr.remote()
        assert remote.length == 100
        assert remote.base == (buf.ctypes.data if stack.info.virt_addr else 0)
        assert fi.RemoteRegion.unpack(remote.pack()) == remote


def test_registering_a_read_only_buffer_is_a_clear_error(fabric):
    with fi.open_endpoint(*fabric) as stack:
        with pytest.raises(fi.UsageError, match="writable buffer"):
            stack.register(b"read-only bytes")
        with pytest.raises(fi.UsageError, match="empty"):
            stack.register(bytearray())
        assert [type(c).__name__ for c in stack.domain.children] == ["CompletionQueue", "AddressVector", "Endpoint"]


def test_cq_error_entry_surfaces_as_fabric_error(fabric):
    """A message larger than the posted receive buffer: the receiver reads an error entry (truncation)."""
    with fi.open_endpoint(*fabric) as rx, fi.open_endpoint(*fabric) as tx:
        small = np.zeros(16, np.uint8)
        big = np.ones(4096, np.uint8)
        rx_mr, tx_mr = rx.register(small), tx.register(big)
        rx.ep.post_recv(rx_mr, 0, 16, token="small-recv")
        dest = tx.av.insert(rx.ep.address())
        with pytest.raises(fi.FabricError) as err:
            posted = False
            for _ in range(200000):  # one process plays both sides, so it progresses both
                posted = posted or tx.ep.try_post_send(tx_mr, 0, 4096, dest, token="big-send")
                tx.cq.poll()
                rx.cq.poll()
        assert err.value.call == "completion"
        assert err.value.errno_name in ("FI_ETRUNC", "FI_EMSGSIZE", "EMSGSIZE")
        assert err.value.token == "small-recv"


def test_fabric_error_names_call_and_errno():
    err = fi.FabricError("fi_demo", -fi.lib.FI_EAGAIN)
    assert err.errno_name == "FI_EAGAIN" and err.call == "fi_demo" and "fi_demo" in str(err)


def test_open_close_cycles_do_not_leak_fds(fabric):
    for _ in range(5):  # let the provider set up its one-time state first
        fi.open_endpoint(*fabric).close()
    gc.collect()
    before = open_fds()
    for _ in range(200):
        with fi.open_endpoint(*fabric) as stack:
            stack.register(np.zeros(64, np.uint8))
    gc.collect()
    assert open_fds() <= before


# ------------------------------------------------------------------------------------------- addresses

def test_address_round_trip(fabric):
    with fi.open_endpoint(*fabric) as stack:
        addr = stack.ep.address(max_message=1234)
        again = fi.Address.parse(addr.hex())
        assert again == addr and again.max_message == 1234
        again.check_compatible(stack.info)


@pytest.mark.parametrize("text, problem", [
    ("", "empty address"),
    ("zz00", "not a hexadecimal digit"),
    ("abc", "odd number of hex digits"),
    ("00" * 10, "truncated address"),
    ("00" * 40, "not a fabriclab address"),
])
def test_malformed_addresses(text, problem):
    with pytest.raises(fi.UsageError, match=problem):
        fi.Address.parse(text)


def test_truncated_and_wrong_provider_addresses():
    with fi.open_endpoint("tcp;ofi_rxm", "lo") as tcp, fi.open_endpoint("shm") as shm:
        line = tcp.ep.address().hex()
        with pytest.raises(fi.UsageError, match="truncated address"):
            fi.Address.parse(line[:-4])
        with pytest.raises(fi.UsageError, match="provider 'tcp;ofi_rxm'.*'shm'"):
            shm.av.insert(fi.Address.parse(line))
        forged = fi.Address("tcp;ofi_rxm", fi.lib.FI_SOCKADDR_IN, b"\x07" * 16)
        with pytest.raises(fi.UsageError, match="not an IPv4 socket address"):
            fi.Address.parse(forged.hex())


def test_the_package_exports_what_its_modules_define():
    # fabriclab.fi is split by object family (info, fabric, cq, av, mr, endpoint, ...); callers use fi.X only,
    # so every public name a module of the package defines is the package's too, the same object.
    import ast
    import importlib
    import pathlib
    unexported = []
    for path in sorted(pathlib.Path(fi.__file__).parent.glob("[!_]*.py")):
        module = importlib.import_module(f"fabriclab.fi.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            unexported += [f"{module.__name__}.{name}" for name in names if not name.startswith("_")
                           and (name not in fi.__all__ or getattr(fi, name) is not getattr(module, name))]
    assert not unexported, f"defined in fabriclab.fi's modules but not fi.X: {unexported}"
    assert {"Endpoint", "getinfo", "FabricError", "RemoteRegion", "Address", "lib"} <= set(fi.__all__)
