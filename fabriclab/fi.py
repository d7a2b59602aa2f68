"""fabriclab.fi — a thin, complete Python binding of the libfabric calls the course uses.

Objects mirror libfabric's tree (Fabric → Domain → CompletionQueue, AddressVector, Endpoint, MemoryRegion)
and are context managers; closing a parent closes its children first, newest first, so an endpoint is
closed before the queues it is bound to. Closing twice is harmless. An object nothing refers to any more is
closed when garbage-collected (a parent holds its children weakly, each child its parent). After fork(),
the child's copies are ``inherited``: using one raises UsageError, closing one never closes the parent's.
Signal handlers libfabric's providers install are given back to the application (``signals_given_back``).

The binding honours what ``fi_getinfo`` returns instead of branching on provider names: memory
registration modes (FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_PROV_KEY, FI_MR_ENDPOINT), the FI_CONTEXT/FI_CONTEXT2
modes (every operation owns a context that stays alive until its completion is read), and the sizes the
provider reports.
"""
from __future__ import annotations

import collections
import errno as _errno
import itertools
import math
import numbers
import operator
import os
import signal
import socket
import string
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable

# libfabric's psm providers load libinfinipath, which installs its own SIGINT/SIGTERM/SIGSEGV handlers
# that end the process without Python's cleanup (no KeyboardInterrupt) unless told not to.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
os.environ.setdefault("HFI_NO_BACKTRACE", "1")

from ._fabric import ffi, lib  # noqa: E402
from . import _inprocess  # noqa: E402

#: Providers in the order fabriclab prefers them when none is named: real RDMA NICs first, then the
#: shared-memory provider (two processes on one host), then TCP (any network, loopback included).
PREFERRED_PROVIDERS = ("efa", "verbs;ofi_rxm", "shm", "tcp;ofi_rxm")
DEFAULT_TIMEOUT = 10.0

DEFAULT_CAPS = lib.FI_MSG | lib.FI_RMA
#: Bytes of immediate data every write carries (a page's or write's sequence number, lesson 06): the hints
#: ask for at least this ``cq_data_size``, so a fabric offering less (some efa-direct releases offer 0) is
#: never chosen, instead of failing at the first write.
IMMEDIATE_DATA_BYTES = 4
# The registration modes fabriclab knows how to honour; the provider picks the ones it needs.
SUPPORTED_MR_MODES = (lib.FI_MR_LOCAL | lib.FI_MR_VIRT_ADDR | lib.FI_MR_ALLOCATED | lib.FI_MR_PROV_KEY
                      | lib.FI_MR_ENDPOINT | lib.FI_MR_HMEM)
SUPPORTED_MODES = lib.FI_CONTEXT | lib.FI_CONTEXT2
ACCESS_ALL = (lib.FI_SEND | lib.FI_RECV | lib.FI_READ | lib.FI_WRITE | lib.FI_REMOTE_READ
              | lib.FI_REMOTE_WRITE)
# What memory that is only ever the source of this side's writes and sends must allow (read-only buffers).
ACCESS_SOURCE = lib.FI_WRITE | lib.FI_SEND

_MR_MODE_NAMES = {lib.FI_MR_LOCAL: "FI_MR_LOCAL", lib.FI_MR_RAW: "FI_MR_RAW",
                  lib.FI_MR_VIRT_ADDR: "FI_MR_VIRT_ADDR", lib.FI_MR_ALLOCATED: "FI_MR_ALLOCATED",
                  lib.FI_MR_PROV_KEY: "FI_MR_PROV_KEY", lib.FI_MR_MMU_NOTIFY: "FI_MR_MMU_NOTIFY",
                  lib.FI_MR_RMA_EVENT: "FI_MR_RMA_EVENT", lib.FI_MR_ENDPOINT: "FI_MR_ENDPOINT",
                  lib.FI_MR_HMEM: "FI_MR_HMEM"}
_MODE_NAMES = {lib.FI_CONTEXT: "FI_CONTEXT", lib.FI_CONTEXT2: "FI_CONTEXT2", lib.FI_RX_CQ_DATA: "FI_RX_CQ_DATA",
               lib.FI_LOCAL_MR: "FI_LOCAL_MR", lib.FI_MSG_PREFIX: "FI_MSG_PREFIX"}
_ADDR_FORMAT_NAMES = {lib.FI_FORMAT_UNSPEC: "FI_FORMAT_UNSPEC", lib.FI_SOCKADDR: "FI_SOCKADDR",
                      lib.FI_SOCKADDR_IN: "FI_SOCKADDR_IN", lib.FI_SOCKADDR_IN6: "FI_SOCKADDR_IN6",
                      lib.FI_SOCKADDR_IB: "FI_SOCKADDR_IB", lib.FI_ADDR_PSMX: "FI_ADDR_PSMX",
                      lib.FI_ADDR_GNI: "FI_ADDR_GNI", lib.FI_ADDR_BGQ: "FI_ADDR_BGQ",
                      lib.FI_ADDR_MLX: "FI_ADDR_MLX", lib.FI_ADDR_STR: "FI_ADDR_STR",
                      lib.FI_ADDR_PSMX2: "FI_ADDR_PSMX2", lib.FI_ADDR_IB_UD: "FI_ADDR_IB_UD",
                      lib.FI_ADDR_EFA: "FI_ADDR_EFA"}
_ERRNO_NAMES = {getattr(lib, n): n for n in dir(lib) if n.startswith("FI_E") and isinstance(getattr(lib, n), int)
                and n not in ("FI_EP_MSG", "FI_EP_DGRAM", "FI_EP_RDM")}


def fi_version(major: int, minor: int) -> int:
    """FI_VERSION(major, minor) of rdma/fabric.h."""
    return (major << 16) | minor


def api_version() -> int:
    """The newest API version both this build's headers and the loaded library speak."""
    return min(lib.fi_version(), fi_version(lib.FI_MAJOR_VERSION, lib.FI_MINOR_VERSION))


def library_version() -> str:
    v = lib.fi_version()
    return f"{v >> 16}.{v & 0xFFFF}"


def flag_names(value: int, names: dict[int, str]) -> list[str]:
    return [name for bit, name in names.items() if value & bit]


# --------------------------------------------------------------------------------------------- errors


class FabriclabError(Exception):
    """The root of every error fabriclab raises on purpose (libfabric failures, bad input, failed
    transfers, the testbed's): ``except fabriclab.FabriclabError`` catches them all, and nothing else."""


class FabricError(FabriclabError, RuntimeError):
    """A libfabric call failed: carries the call, the errno (positive) and its name, and libfabric's text.

    ``detail`` holds provider-specific text (``fi_cq_strerror``) for errors read from a completion queue,
    ``token`` the caller's token of the operation that failed, when there is one.
    """

    def __init__(self, call: str, code: int, detail: str = "", token: Any = None, message: str | None = None):
        self.call = call
        self.errno = abs(int(code))
        self.errno_name = errno_name(self.errno)
        self.strerror = ffi.string(lib.fi_strerror(self.errno)).decode(errors="replace")
        self.detail = detail
        self.token = token
        text = message or f"{call} failed: {self.errno_name} ({self.strerror})"
        if detail:
            text += f": {detail}"
        self.text = text
        super().__init__(text)

    def __str__(self) -> str:
        return self.text


class FabricTimeout(FabricError, TimeoutError):
    """A wait ran out of time: the peer is gone, stalled, or never answered."""

    def __init__(self, what: str, timeout: float, hint: str = ""):
        msg = f"{what} did not happen within {timeout:g} s"
        if hint:
            msg += f" ({hint})"
        super().__init__(what, lib.FI_ETIMEDOUT, message=msg)
        self.timeout = timeout


class UsageError(FabriclabError, ValueError):
    """Bad input detected before any libfabric call: the message names the problem and the fix."""


def integer(value, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (numpy's too); never a bool (numpy's either: named, not imported, since it is no int
    subclass) or a float, which would be silently truncated."""
    if type(value).__name__ in ("bool", "bool_"):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise UsageError(f"{name} must be {bounds}, got {value}")
    return value


def seconds(value, name: str, default: float | None = None, zero_means: str | None = None) -> float:
    """A number of seconds for a deadline: finite and larger than zero (``None``: the default). Zero or
    less would fail every wait at once, nan never compares, inf turns a dead peer into a hang. With
    ``zero_means``, 0 is allowed too ("failover off", say)."""
    if value is None and default is not None:
        return default
    number = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if number and float(value) == 0 and zero_means:
        return 0.0
    if not number or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{name} must be a finite number larger than zero"
                         f"{f', or 0 to turn {zero_means}' if zero_means else ''}, got {value!r}")
    return float(value)


def errno_name(code: int) -> str:
    code = abs(int(code))
    fi_name = _ERRNO_NAMES.get(code)
    if fi_name:
        return fi_name
    return _errno.errorcode.get(code, f"errno {code}")


def check(rc: int, call: str) -> int:
    if rc < 0:
        raise FabricError(call, rc)
    return rc


# --------------------------------------------------------------------------------------------- signals

# Every signal a handler can be installed for: whichever a provider takes, it is given back.
_SIGNALS = sorted(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))
_signals_c = ffi.new("int[]", _SIGNALS)
_signals_lock = threading.Lock()
_given_back: set[int] = set()


def _keeping_signal_handlers(call: Callable[..., int], *args) -> int:
    """Make a libfabric call that may install signal handlers, then put back every handler it replaced.

    libfabric's shm provider, at the first fi_endpoint of a process (measured on 1.17 with
    native/signals.c; other providers and versions may do it when they initialise, so fi_getinfo,
    fi_fabric, fi_domain and fi_enable go through here too), installs handlers for SIGINT, SIGTERM, SIGSEGV
    and SIGBUS that delete the process's /dev/shm regions and then chain to the previous handler. Under
    Python SIGINT becomes KeyboardInterrupt and the process lives on without its region: the next peer
    it writes to maps the vanished region and crashes in fi_cq_read. With the previous handlers back,
    Ctrl-C is a KeyboardInterrupt that keeps the region, SIGTERM still terminates, and a process that dies
    of a signal leaves its region to ``fabriclab clean`` (and the next engine start) to reclaim. The lock
    keeps a concurrent call from snapshotting the provider's handlers as if they were the application's."""
    with _signals_lock:
        snapshot = lib.fl_signals_snapshot(_signals_c, len(_SIGNALS))
        if snapshot == ffi.NULL:
            raise MemoryError("fl_signals_snapshot")
        try:
            return call(*args)
        finally:
            restored = ffi.new("int[]", len(_SIGNALS))
            n = lib.fl_signals_restore(snapshot, restored, len(_SIGNALS))
            lib.fl_signals_free(snapshot)
            if n < 0:
                raise OSError(-n, f"sigaction could not give back the signal handlers libfabric replaced: "
                                  f"{os.strerror(-n)}")
            _given_back.update(restored[i] for i in range(n))


def signals_given_back() -> frozenset[signal.Signals]:
    """The signals whose handlers libfabric replaced in this process and fabriclab put back (on shm:
    SIGINT, SIGTERM, SIGSEGV, SIGBUS once the first endpoint is open; empty before)."""
    return frozenset(signal.Signals(s) for s in _given_back)


# ----------------------------------------------------------------------------------------------- info


@dataclass(frozen=True)
class Nic:
    """What fi_getinfo says about the NIC behind a domain (all optional: software providers say little)."""
    name: str | None
    pci: str | None
    link_speed_bps: int | None
    link_state: str | None
    mtu: int | None

    def describe(self) -> str:
        parts = [self.name or "?"]
        if self.pci:
            parts.append(f"pci {self.pci}")
        if self.link_speed_bps:
            parts.append(f"link {self.link_speed_bps / 1e9:g} Gbps")
        return ", ".join(parts)


def _cstr(ptr) -> str | None:
    return ffi.string(ptr).decode(errors="replace") if ptr != ffi.NULL else None


class _InfoList:
    """Owns one fi_getinfo result and frees it when nothing refers to it any more."""

    def __init__(self, head):
        self.head = head
        weakref.finalize(self, lib.fi_freeinfo, head)


class Info:
    """One fi_info entry: a provider on a domain (a NIC), with the attributes fabriclab relies on."""

    def __init__(self, owner: _InfoList, ptr):
        self._owner = owner
        self.ptr = ptr
        d, f, ep, tx, rx = ptr.domain_attr, ptr.fabric_attr, ptr.ep_attr, ptr.tx_attr, ptr.rx_attr
        self.provider = _cstr(f.prov_name)
        self.fabric = _cstr(f.name)
        self.domain = _cstr(d.name)
        self.caps = int(ptr.caps)
        self.mode = int(ptr.mode)
        self.mr_mode = int(d.mr_mode)
        self.addr_format = int(ptr.addr_format)
        self.max_msg_size = int(ep.max_msg_size)
        self.inject_size = int(tx.inject_size)
        self.cq_data_size = int(d.cq_data_size)
        self.tx_size = int(tx.size)
        self.rx_size = int(rx.size)
        self.threading = int(d.threading)
        self.data_progress = int(d.data_progress)
        self.msg_order = int(tx.msg_order)  # what the provider keeps in order between one endpoint's operations
        self.op_flags = int(tx.op_flags)  # default flags, among them the completion level (none: transmit)
        self.max_order_waw_size = int(ep.max_order_waw_size)
        self.hmem = bool(self.caps & lib.FI_HMEM)
        self.nic = self._nic(ptr.nic)

    @staticmethod
    def _nic(nic) -> Nic | None:
        if nic == ffi.NULL:
            return None
        name = pci = state = None
        speed = mtu = None
        if nic.device_attr != ffi.NULL:
            name = _cstr(nic.device_attr.name)
        if nic.bus_attr != ffi.NULL and nic.bus_attr.bus_type == lib.FI_BUS_PCI:
            p = nic.bus_attr.attr.pci
            pci = f"{p.domain_id:04x}:{p.bus_id:02x}:{p.device_id:02x}.{p.function_id:x}"
        if nic.link_attr != ffi.NULL:
            speed = int(nic.link_attr.speed) or None
            mtu = int(nic.link_attr.mtu) or None
            state = "up" if nic.link_attr.state == lib.FI_LINK_UP else "down"
        return Nic(name, pci, speed, state, mtu)

    @property
    def orders_writes(self) -> bool:
        """An endpoint's RMA writes land in the order they were posted, whatever their size (FI_ORDER_WAW or
        FI_ORDER_RMA_WAW in msg_order, and max_order_waw_size unbounded): only then does a write's arrival
        prove that the earlier ones arrived (tcp;ofi_rxm; not EFA's RDM endpoints, shm or sim)."""
        ordered = self.msg_order & (lib.FI_ORDER_WAW | lib.FI_ORDER_RMA_WAW)
        return bool(ordered) and self.max_order_waw_size == 2 ** (8 * ffi.sizeof("size_t")) - 1

    @property
    def mr_mode_names(self) -> list[str]:
        return flag_names(self.mr_mode, _MR_MODE_NAMES)

    @property
    def mode_names(self) -> list[str]:
        return flag_names(self.mode, _MODE_NAMES)

    @property
    def addr_format_name(self) -> str:
        return _ADDR_FORMAT_NAMES.get(self.addr_format, str(self.addr_format))

    @property
    def virt_addr(self) -> bool:
        """Remote addresses are virtual addresses (else offsets into the registered region)."""
        return bool(self.mr_mode & lib.FI_MR_VIRT_ADDR)

    @property
    def mr_endpoint(self) -> bool:
        """Registrations are bound to one endpoint (FI_MR_ENDPOINT), so each endpoint needs its own."""
        return bool(self.mr_mode & lib.FI_MR_ENDPOINT)

    @property
    def modeled(self) -> bool:
        """A modeled NIC (provider ``sim``, fabric ``modeled-...``): its figures are the model's, not a wire's."""
        return (self.fabric or "").startswith("modeled-")

    @property
    def moves_payload(self) -> bool:
        """Whether written bytes reach the target: every real provider; the model only in payload mode
        (fabric ``modeled-...-payload``, FABRICLAB_SIM_PAYLOAD=1)."""
        return not self.modeled or (self.fabric or "").endswith("-payload")

    @property
    def prov_key(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_PROV_KEY)

    def __repr__(self) -> str:
        return f"<Info provider={self.provider!r} domain={self.domain!r} fabric={self.fabric!r}>"


def _hints(provider: str | None, caps: int, ep_type: int, cq_data_size: int = 0):
    hints = lib.fi_allocinfo()
    if hints == ffi.NULL:
        raise MemoryError("fi_allocinfo")
    hints.caps = caps
    hints.mode = SUPPORTED_MODES
    hints.ep_attr.type = ep_type
    hints.domain_attr.mr_mode = SUPPORTED_MR_MODES
    hints.domain_attr.cq_data_size = cq_data_size
    if provider:
        hints.fabric_attr.prov_name = lib.strdup(provider.encode())  # fi_freeinfo frees it
    return hints


# ------------------------------------------------------------------------- the modeled NICs' provider

#: fabriclab's model of a p5's NICs (docs/model.md), a libfabric provider built with the package. Never the
#: default: libfabric loads it only when it is asked for before libfabric's first initialisation.
MODELED_PROVIDER = "sim"
MODELED_PROVIDER_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libsim-fi.so")
_libfabric_started = False


def _libfabric_provider_dir() -> str:
    """libfabric's own provider directory (<libdir>/libfabric), which FI_PROVIDER_PATH would otherwise hide."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libfabric.so"):
                return os.path.join(os.path.dirname(path), "libfabric")
    return "/usr/lib/libfabric"


def modeled_provider_loaded() -> bool:
    """Whether libfabric in this process looks for providers in fabriclab's directory (FI_PROVIDER_PATH)."""
    here = os.path.dirname(MODELED_PROVIDER_LIBRARY)
    return here in os.environ.get("FI_PROVIDER_PATH", "").lstrip("@").split(":")


def load_modeled_provider() -> None:
    """Point libfabric at the modeled-NIC provider (``sim``), keeping the directories it searched before.
    libfabric reads FI_PROVIDER_PATH once, at its first initialisation: after that, UsageError says how
    to start over."""
    if modeled_provider_loaded():
        return
    if not os.path.exists(MODELED_PROVIDER_LIBRARY):
        raise UsageError(f"the modeled-NIC provider {MODELED_PROVIDER!r} is not built ({MODELED_PROVIDER_LIBRARY} "
                         "is missing): run `make setup` (or `pip install -e .`) to build it")
    if _libfabric_started:
        raise UsageError(f"provider {MODELED_PROVIDER!r} was asked for after libfabric had started in this process "
                         "without it (libfabric reads FI_PROVIDER_PATH once): set FABRICLAB_PROVIDER=sim before "
                         "starting Python, or make fi.getinfo('sim') the process's first libfabric call")
    current = os.environ.get("FI_PROVIDER_PATH", "")
    prefix, current = ("@", current[1:]) if current.startswith("@") else ("", current)
    dirs = [os.path.dirname(MODELED_PROVIDER_LIBRARY)] + (current.split(":") if current
                                                          else [_libfabric_provider_dir()])
    os.environ["FI_PROVIDER_PATH"] = prefix + ":".join(dirs)


def _before_libfabric_starts(provider: str | None) -> None:
    global _libfabric_started
    if MODELED_PROVIDER in (provider, os.environ.get("FABRICLAB_PROVIDER")):
        load_modeled_provider()
    _libfabric_started = True


def _getinfo_raw(provider: str | None, caps: int, ep_type: int, cq_data_size: int = 0) -> list[Info]:
    _before_libfabric_starts(provider)
    hints = _hints(provider, caps, ep_type, cq_data_size)
    out = ffi.new("struct fi_info **")
    try:
        rc = _keeping_signal_handlers(lib.fi_getinfo, api_version(), ffi.NULL, ffi.NULL, 0, hints, out)
    finally:
        lib.fi_freeinfo(hints)
    if rc == -lib.FI_ENODATA:
        return []
    check(rc, f"fi_getinfo(provider={provider!r})")
    owner = _InfoList(out[0])
    infos, seen, p = [], set(), out[0]
    while p != ffi.NULL:
        info = Info(owner, p)
        # Providers list one entry per variant they support (threading, progress, ...); keep the first.
        key = (info.provider, info.fabric, info.domain, info.addr_format)
        if key not in seen:
            seen.add(key)
            infos.append(info)
        p = p.next
    return infos


def available_providers(caps: int = DEFAULT_CAPS, ep_type: int = lib.FI_EP_RDM) -> list[str]:
    """Names of the providers that offer reliable-datagram endpoints with these capabilities here."""
    seen = []
    for info in _getinfo_raw(None, caps, ep_type):
        if info.provider not in seen:
            seen.append(info.provider)
    return seen


def default_provider(caps: int = DEFAULT_CAPS) -> str:
    """$FABRICLAB_PROVIDER, else the first of PREFERRED_PROVIDERS available here."""
    named = os.environ.get("FABRICLAB_PROVIDER")
    if named:
        return named
    available = available_providers(caps)
    for name in PREFERRED_PROVIDERS:
        if name in available:
            return name
    available = [name for name in available if name != MODELED_PROVIDER]
    if available:
        return available[0]
    raise FabricError("fi_getinfo", lib.FI_ENODATA,
                      message="no libfabric provider offers reliable-datagram endpoints on this machine "
                              "(is libfabric installed? try `fi_info -l`)")


#: Providers that carry RDM over IP: their domains are network interfaces, the loopback among them.
IP_PROVIDERS = ("tcp", "udp", "sockets", "net")
LOOPBACK = "lo"


def same_host_fabric(provider: str | None = None) -> tuple[str, str | None]:
    """(provider, domain) for two processes on this host: the default provider ($FABRICLAB_PROVIDER, else
    the best available), and for IP-based providers the loopback interface, whatever $FABRICLAB_DOMAIN
    says (another interface would send the traffic out of the host and back)."""
    provider = provider or default_provider()
    ip_based = any(part.strip() in IP_PROVIDERS for part in provider.split(";"))
    return provider, LOOPBACK if ip_based else None


def getinfo(provider: str | None = None, domain: str | None = None, *, caps: int = DEFAULT_CAPS,
            hmem: bool | None = False, ep_type: int = lib.FI_EP_RDM, fabric: str | None = None,
            cq_data_size: int = IMMEDIATE_DATA_BYTES) -> list[Info]:
    """fi_getinfo for reliable-datagram endpoints: every (provider, fabric, domain) entry that fits.

    ``provider`` defaults to $FABRICLAB_PROVIDER, then the best available (see PREFERRED_PROVIDERS);
    ``fabric`` (such as ``efa`` or ``efa-direct``, which list the same domains) to $FABRICLAB_FABRIC, else
    every fabric; ``domain`` (a NIC name such as ``lo`` or ``rdmap79s0-rdm``) to $FABRICLAB_DOMAIN when that
    names one of the provider's domains, else all of them. ``hmem=False`` (host memory only) leaves
    FI_HMEM out, ``True`` insists on it, ``None`` asks for it and quietly drops it when not offered.
    ``cq_data_size``: the least immediate data asked for in the hints (0 shows every entry).
    """
    provider = provider or default_provider(caps)
    if not isinstance(provider, str) or not provider.strip():
        raise UsageError("provider must be a non-empty string such as 'shm' or 'tcp;ofi_rxm'")
    infos = []
    if hmem is not False:
        infos = _getinfo_raw(provider, caps | lib.FI_HMEM, ep_type, cq_data_size)
    if not infos and not hmem:
        infos = _getinfo_raw(provider, caps, ep_type, cq_data_size)
    if not infos:
        available = available_providers(caps, ep_type)
        if provider in available and hmem:
            raise UsageError(f"provider {provider!r} does not offer FI_HMEM (device memory) here")
        if provider in available and cq_data_size:
            raise UsageError(f"provider {provider!r} offers less than {cq_data_size} bytes of immediate data "
                             "(cq_data_size) here, which every write carries; `python -m fabriclab doctor` "
                             "shows what it offers")
        raise UsageError(f"unknown or unusable provider {provider!r}; available here: "
                         f"{', '.join(available) or 'none'} (set --provider or FABRICLAB_PROVIDER)")
    fabric = fabric or os.environ.get("FABRICLAB_FABRIC")
    if fabric:
        named = [i for i in infos if i.fabric == fabric]
        if not named:
            names = ", ".join(dict.fromkeys(i.fabric for i in infos))
            raise UsageError(f"provider {provider!r} has no fabric {fabric!r} (with {cq_data_size}-byte immediate "
                             f"data); its fabrics here: {names} (set --fabric or FABRICLAB_FABRIC)")
        infos = named
    infos = provider_fabric_first(infos)
    wanted = domain or os.environ.get("FABRICLAB_DOMAIN")
    if wanted:
        chosen = [i for i in infos if i.domain == wanted]
        if chosen:
            return chosen
        if domain:
            names = sorted({i.domain for i in infos})
            raise UsageError(f"provider {provider!r} has no domain {domain!r}; its domains here: {', '.join(names)}")
    return infos


def domains(provider: str | None = None, *, caps: int = DEFAULT_CAPS, hmem: bool | None = False,
            fabric: str | None = None, cq_data_size: int = IMMEDIATE_DATA_BYTES) -> list[Info]:
    """One Info per distinct domain (NIC) of a provider: the NICs fabriclab drives.

    Where one domain is listed under several fabrics, getinfo puts the fabric named like the provider
    first, else keeps libfabric's order: libfabric 2.x lists each EFA NIC as ``efa-direct`` first and
    ``efa`` (RDM, with its same-host path and emulated protocols) second, and fabriclab wants ``efa`` unless
    ``fabric`` (or $FABRICLAB_FABRIC) names another. tcp lists a NIC once per address family; the first
    is kept.
    """
    return one_fabric_per_nic(getinfo(provider, caps=caps, hmem=hmem, fabric=fabric, cq_data_size=cq_data_size))


def provider_fabric_first(infos: list[Info]) -> list[Info]:
    """The entries, those whose fabric is named like their provider first (``efa`` before ``efa-direct``),
    otherwise in libfabric's order: so ``getinfo(...)[0]`` and every NIC set take the RDM fabric on EFA."""
    return sorted(infos, key=lambda i: i.fabric != i.provider)


def one_fabric_per_nic(infos: list[Info]) -> list[Info]:
    """One entry per domain (NIC), the first of provider_fabric_first's order."""
    chosen: dict[str, Info] = {}
    for info in provider_fabric_first(infos):
        chosen.setdefault(info.domain, info)
    return list(chosen.values())


# ----------------------------------------------------------------------------------- resource tree

# The process running now, refreshed in a child after fork(): a libfabric object belongs to the process
# that opened it. Comparing with a variable, not calling os.getpid(), keeps a system call off every post.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid, _signals_lock
    _pid = os.getpid()
    _signals_lock = threading.Lock()  # another thread of the parent may have held it at fork()
    _inprocess.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Native:
    """The libfabric side of one Resource: its fid, the process that opened it, its children's _Native.

    Kept apart from the Resource so that a finalizer can close it without referring to the Resource (a
    finalizer holding its object keeps it alive for ever; one holding a weak reference finds it already
    dead at collection). A parent holds its children's _Native strongly and the children themselves
    weakly, while each child holds its parent: a dropped child is closed when collected, and a parent
    closes whatever is still open under it, newest first, even children being collected along with it.
    """

    __slots__ = ("kind", "fid", "pid", "closed", "children", "parent", "owner")

    def __init__(self, kind: str, parent: "_Native | None", owner: "Resource"):
        self.kind = kind
        self.fid = None  # struct fid * once opened
        self.pid = _pid
        self.closed = False
        self.children: list[_Native] = []
        self.parent = parent
        self.owner = weakref.ref(owner)
        if parent is not None:
            parent.children.append(self)

    def close(self) -> "FabricError | None":
        """Close what is open under this object (newest first), then the object; the first failure.

        In a process other than the opener (a child after fork()) nothing is closed, only forgotten: the
        libfabric object is the opener's, and closing an inherited shm endpoint deletes the opener's
        /dev/shm region (its name is per process)."""
        if self.closed:
            return None
        self.closed = True
        first_error = None
        for child in reversed(self.children[:]):  # each child unlinks itself from this list
            error = child.close()
            first_error = first_error or error
        if self.fid is not None and self.pid == _pid:
            if not _inprocess.close_now(self):
                return first_error  # an endpoint of this process still holds its address: closed later
            rc = lib.fi_close(self.fid)
            if rc < 0:
                first_error = first_error or FabricError(f"fi_close({self.kind})", rc)
        self._forget()
        return first_error

    def _forget(self) -> None:
        """The libfabric object is gone: off the parent's list; close what waited for it (fabriclab._inprocess)."""
        self.fid = None
        if self.parent is not None and self in self.parent.children:
            self.parent.children.remove(self)
        for waiting in _inprocess.closed(self) if self.pid == _pid else ():
            lib.fi_close(waiting.fid)  # closed for Python long ago: nobody is left to tell of a failure
            waiting._forget()

    def collect(self) -> None:
        """The finalizer: the Resource was garbage-collected (or the interpreter is exiting) unclosed."""
        self.close()  # nobody is left to tell of a failure

    def where(self) -> str:
        """Why the object cannot be used here, or '' when it can."""
        if self.closed:
            return f"{self.kind} is closed"
        if self.pid != _pid:
            return (f"this {self.kind} was created in process {self.pid} before fork(); open a new one in the "
                    f"child (process {_pid})")
        return ""


class Resource:
    """A libfabric object: a context manager that closes its children (newest first) before itself.

    A Resource nothing refers to any more is closed when garbage-collected; a root (Fabric) still open at
    interpreter exit is closed then, with everything under it. After fork(), the child's copies are
    ``inherited``: any use raises UsageError, and ``close()`` (or collection) only drops the Python side,
    never closing what belongs to the parent.
    """

    def __init__(self, parent: "Resource | None"):
        if parent is not None:
            problem = parent._native.where()
            if problem:
                raise UsageError(f"cannot create a {type(self).__name__} here: {problem}")
        self.parent = parent
        self._handle = None  # the struct fid_* * libfabric returned
        self._native = _Native(type(self).__name__, parent._native if parent is not None else None, self)
        self._finalizer = weakref.finalize(self, self._native.collect)
        # At exit only roots close, each its whole tree: a child closed on its own by weakref.finalize's
        # newest-first exit order could go before an engine still writing from it (fabriclab.Engine
        # closes at exit through a finalizer of its own, created after its fabrics).
        self._finalizer.atexit = parent is None

    def _opened(self, ptr) -> None:
        """Record the libfabric object just opened (a struct fid_* *)."""
        self._native.fid = ffi.addressof(ptr[0], "fid")
        self._handle = ptr

    @property
    def _ptr(self):
        """The libfabric object, for calls on it: UsageError once closed, or in a child after fork()."""
        self._require_open()
        return self._handle

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def inherited(self) -> bool:
        """True in a child process that got this object through fork(): it belongs to the parent (``pid``)."""
        return self._native.pid != _pid

    @property
    def pid(self) -> int:
        """The process that opened this object."""
        return self._native.pid

    def _fid(self):
        self._require_open()
        return self._native.fid

    def close(self) -> None:
        native = self._native
        if native.closed:
            return
        first_error = None
        for child in reversed(self.children):  # live children also drop their Python side
            try:
                child.close()
            except FabricError as exc:
                first_error = first_error or exc
        error = native.close()  # what is left under it (children no longer referred to), then itself
        first_error = first_error or error
        self._finalizer.detach()
        self._handle = None
        self._release()
        if first_error is not None:
            raise first_error

    def keep_open(self) -> None:
        """Leave this object open for the life of the process, even at interpreter exit (only its root's
        finalizer closes anything then): as long as a reference to it lives, nothing closes it."""
        self._finalizer.detach()

    def _release(self) -> None:
        """Drop Python-side references once the libfabric object is gone."""

    def _require_open(self) -> None:
        native = self._native
        if native.closed or native.pid != _pid:
            raise UsageError(native.where())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        _close_keeping(self, exc)
        return False

    @property
    def children(self) -> list["Resource"]:
        """The open children still referred to from Python, oldest first."""
        return [c for c in (n.owner() for n in self._native.children if not n.closed) if c is not None]


class Fabric(Resource):
    """fi_fabric for an Info; the root of a resource tree (closed when collected, or at interpreter exit)."""

    def __init__(self, info: Info):
        super().__init__(None)
        self.info = info
        out = ffi.new("struct fid_fabric **")
        check(_keeping_signal_handlers(lib.fi_fabric, info.ptr.fabric_attr, out, ffi.NULL), "fi_fabric")
        self._opened(out[0])

    def domain(self, info: Info | None = None) -> "Domain":
        return Domain(self, info or self.info)


class Domain(Resource):
    """fi_domain: one NIC (or one software domain such as shm, or one network interface under tcp)."""

    def __init__(self, fabric: Fabric, info: Info | None = None):
        super().__init__(fabric)
        self.info = info or fabric.info
        out = ffi.new("struct fid_domain **")
        check(_keeping_signal_handlers(lib.fi_domain, fabric._ptr, self.info.ptr, out, ffi.NULL),
              f"fi_domain({self.info.domain})")
        self._opened(out[0])
        self._next_key = itertools.count(1)

    def completion_queue(self, size: int = 0) -> "CompletionQueue":
        return CompletionQueue(self, size)

    def address_vector(self) -> "AddressVector":
        return AddressVector(self)

    def endpoint(self, cq: "CompletionQueue", av: "AddressVector") -> "Endpoint":
        return Endpoint(self, cq, av)

    def register(self, buffer, **kw) -> "MemoryRegion":
        return MemoryRegion(self, buffer, **kw)


@dataclass
class Completion:
    """One completion queue entry. ``token`` is what the poster passed (None for remote writes' data)."""
    token: Any
    flags: int
    length: int
    data: int

    @property
    def is_remote_write(self) -> bool:
        return bool(self.flags & lib.FI_REMOTE_WRITE)

    @property
    def has_data(self) -> bool:
        return bool(self.flags & lib.FI_REMOTE_CQ_DATA)


class CompletionQueue(Resource):
    """fi_cq_open with FI_CQ_FORMAT_DATA. Keeps each posted operation's context alive until it completes.

    ``poll`` returns completions; an error entry raises FabricError with fi_cq_strerror's text and the
    failed operation's token.
    """

    BATCH = 16

    def __init__(self, domain: Domain, size: int = 0):
        super().__init__(domain)
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_obj = lib.FI_WAIT_NONE
        out = ffi.new("struct fid_cq **")
        check(lib.fi_cq_open(domain._ptr, attr, out, ffi.NULL), "fi_cq_open")
        self._opened(out[0])
        self._entries = ffi.new("struct fi_cq_data_entry[]", self.BATCH)
        self._err = ffi.new("struct fi_cq_err_entry *")
        self._errbuf = ffi.new("char[]", 256)
        self._inflight: dict[int, tuple[Any, Any, Any]] = {}
        self._backlog: collections.deque[Completion] = collections.deque()
        self.polls = 0

    def new_context(self, token: Any, mr: "MemoryRegion | None" = None):
        """A fresh operation context (big enough for FI_CONTEXT and FI_CONTEXT2) tied to ``token``; it holds
        ``mr``, the operation's memory, until the completion is read: a region dropped by the caller while
        the provider still uses it is not deregistered (closed when collected) before then."""
        ctx = ffi.new("struct fi_context2 *")
        self._inflight[int(ffi.cast("uintptr_t", ctx))] = (ctx, token, mr)
        return ctx

    def forget_context(self, ctx) -> None:
        """Undo new_context for an operation that was never posted (e.g. the post returned -FI_EAGAIN)."""
        self._inflight.pop(int(ffi.cast("uintptr_t", ctx)), None)

    @property
    def outstanding(self) -> int:
        """Operations posted through this queue whose completion has not been read yet."""
        return len(self._inflight)

    def _token(self, op_context) -> Any:
        if op_context == ffi.NULL:
            return None
        ctx = self._inflight.pop(int(ffi.cast("uintptr_t", op_context)), None)
        return ctx[1] if ctx else None

    def poll(self, max_entries: int = BATCH) -> list[Completion]:
        """Read up to max_entries completions without blocking (this also drives software progress)."""
        self._require_open()
        if self._backlog:
            return [self._backlog.popleft() for _ in range(min(max_entries, len(self._backlog)))]
        self.polls += 1
        n = lib.fi_cq_read(self._ptr, self._entries, min(max_entries, self.BATCH))
        if n == -lib.FI_EAGAIN:
            return []
        if n == -lib.FI_EAVAIL:
            self._raise_error_entry()
        check(n, "fi_cq_read")
        e = self._entries
        return [Completion(self._token(e[i].op_context), int(e[i].flags), int(e[i].len), int(e[i].data))
                for i in range(n)]

    def progress(self) -> None:
        """Drive progress while keeping completions for the next poll (used while retrying -FI_EAGAIN)."""
        if not self._backlog:
            self._backlog.extend(self.poll())

    def _raise_error_entry(self):
        rc = lib.fi_cq_readerr(self._ptr, fresh_error_entry(self._err), 0)
        if rc < 0:
            raise FabricError("fi_cq_readerr", rc)
        err = self._err
        detail = lib.fi_cq_strerror(self._ptr, err.prov_errno, err.err_data, self._errbuf, len(self._errbuf))
        text = _cstr(detail) or ""
        token = self._token(err.op_context)
        raise FabricError("completion", err.err, detail=text, token=token)

    def wait(self, done: Callable[[], bool], timeout: float, what: str,
             on_completion: Callable[[Completion], None], hint: str = "") -> None:
        """Poll until ``done()`` is true, handing each completion to ``on_completion``; FabricTimeout
        after ``timeout`` seconds. Spins while busy, then backs off gently so an idle peer does not burn
        a core (software providers only progress while someone polls)."""
        deadline = time.monotonic() + timeout
        idle_since = time.monotonic()
        while not done():
            got = self.poll()
            for c in got:
                on_completion(c)
            now = time.monotonic()
            if got:
                idle_since = now
            elif now > deadline:
                raise FabricTimeout(what, timeout, hint)
            elif now - idle_since > 0.05:
                time.sleep(0.0002)

    def _release(self) -> None:
        self._inflight.clear()
        self._backlog.clear()


class AddressVector(Resource):
    """fi_av_open: maps peers' raw addresses to fi_addr_t handles."""

    def __init__(self, domain: Domain):
        super().__init__(domain)
        attr = ffi.new("struct fi_av_attr *")
        attr.type = domain.info.ptr.domain_attr.av_type
        out = ffi.new("struct fid_av **")
        check(lib.fi_av_open(domain._ptr, attr, out, ffi.NULL), "fi_av_open")
        self._opened(out[0])
        self.info = domain.info

    def insert(self, address: "Address | bytes") -> int:
        """Insert one peer; returns its fi_addr_t. A bytes argument is taken as this provider's raw format."""
        self._require_open()
        raw = address.raw if isinstance(address, Address) else bytes(address)
        if isinstance(address, Address):
            address.check_compatible(self.info)
        out = ffi.new("fi_addr_t *")
        n = lib.fi_av_insert(self._ptr, raw, 1, out, 0, ffi.NULL)
        if n != 1:
            raise FabricError("fi_av_insert", n if n < 0 else lib.FI_EINVAL,
                              message=None if n < 0 else "fi_av_insert rejected the address")
        _inprocess.address_inserted(self._native, raw)  # an endpoint of this process: it waits for us to close
        return int(out[0])

    def remove(self, fi_addr: int) -> None:
        self._require_open()
        addrs = ffi.new("fi_addr_t[1]", [fi_addr])
        check(lib.fi_av_remove(self._ptr, addrs, 1, 0), "fi_av_remove")


class MemoryRegion(Resource):
    """fi_mr_regattr over a writable buffer (numpy array, bytearray, memoryview) or a raw pointer.

    Registration follows the domain's mr_mode: a key of the caller's choosing unless FI_MR_PROV_KEY,
    binding to an endpoint under FI_MR_ENDPOINT, and remote addresses that are virtual addresses under
    FI_MR_VIRT_ADDR or offsets otherwise (``remote_base``).
    """

    def __init__(self, domain: Domain, buffer=None, *, pointer: int | None = None, length: int | None = None,
                 iface: int = lib.FI_HMEM_SYSTEM, device: int = 0, access: int = ACCESS_ALL,
                 endpoint: "Endpoint | None" = None, keepalive: Any = None):
        super().__init__(domain)
        try:
            self._register(domain, buffer, pointer, length, iface, device, access, endpoint, keepalive)
        except BaseException:
            self.close()
            raise

    def _register(self, domain, buffer, pointer, length, iface, device, access, endpoint, keepalive):
        if buffer is not None:
            written = bool(access & (lib.FI_RECV | lib.FI_READ | lib.FI_REMOTE_WRITE))  # else only read from
            try:
                self._view = ffi.from_buffer(buffer, require_writable=written)
            except (TypeError, BufferError, ValueError) as exc:
                raise UsageError(f"cannot register {type(buffer).__name__} for writing into: needs a writable "
                                 f"buffer (numpy array, bytearray, memoryview) ({exc})") from None
            self.address = int(ffi.cast("uintptr_t", self._view))
            self.length = len(self._view)
        else:
            if pointer is None or length is None:
                raise UsageError("register a buffer, or give both pointer= and length=")
            self._view = None
            self.address, self.length = int(pointer), int(length)
        if self.length <= 0:
            raise UsageError("cannot register an empty buffer")
        self.buffer = buffer
        self.iface = iface
        self._keepalive = keepalive
        self.info = domain.info
        iov = ffi.new("struct iovec *")
        iov.iov_base = ffi.cast("void *", self.address)
        iov.iov_len = self.length
        attr = ffi.new("struct fi_mr_attr *")
        attr.mr_iov = iov
        attr.iov_count = 1
        attr.access = access
        attr.requested_key = 0 if self.info.prov_key else next(domain._next_key)
        attr.iface = iface
        if iface != lib.FI_HMEM_SYSTEM:
            attr.device.cuda = device
        out = ffi.new("struct fid_mr **")
        check(lib.fi_mr_regattr(domain._ptr, attr, 0, out), f"fi_mr_regattr({self.length} bytes)")
        self._opened(out[0])
        if self.info.mr_endpoint:
            if endpoint is None:
                raise UsageError(f"provider {self.info.provider} binds memory to an endpoint (FI_MR_ENDPOINT): "
                                 "pass endpoint=")
            check(lib.fi_mr_bind(self._ptr, ffi.addressof(endpoint._ptr[0], "fid"), 0), "fi_mr_bind")
            check(lib.fi_mr_enable(self._ptr), "fi_mr_enable")
        self.desc = lib.fi_mr_desc(self._ptr)
        self.key = int(lib.fi_mr_key(self._ptr))

    @property
    def remote_base(self) -> int:
        """What a peer writes to for offset 0: our virtual address under FI_MR_VIRT_ADDR, else 0."""
        return self.address if self.info.virt_addr else 0

    def remote(self) -> "RemoteRegion":
        """What a peer needs to write here: base address (per FI_MR_VIRT_ADDR), length and key."""
        self._require_open()  # a peer told of a closed or inherited registration would write elsewhere
        return RemoteRegion(self.remote_base, self.length, self.key)

    def pointer(self, offset: int = 0):
        return ffi.cast("void *", self.address + offset)

    def check_range(self, offset: int, length: int, what: str = "local buffer") -> None:
        """Every post checks its buffer here: in range, and registered in this process and still open."""
        self._require_open()
        if offset < 0 or length < 0 or offset + length > self.length:
            raise UsageError(f"{what}: bytes [{offset}, {offset + length}) fall outside the "
                             f"{self.length}-byte registered region")

    def _release(self) -> None:
        self._view = None
        self.buffer = None
        self._keepalive = None


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory as seen from here: where offset 0 is, how long it is, its key.

    Packed for the wire with a CRC, so a descriptor that was truncated or altered on the way (a wrong
    key, a wrong length) is rejected before any write is posted with it."""
    base: int
    length: int
    key: int

    FORMAT = struct.Struct("<QQQI")
    SIZE = FORMAT.size

    def pack(self) -> bytes:
        fields = struct.pack("<QQQ", self.base, self.length, self.key)
        return fields + struct.pack("<I", zlib.crc32(fields))

    @classmethod
    def unpack(cls, data: bytes) -> "RemoteRegion":
        if data is None or len(data) == 0:
            raise UsageError("missing remote region descriptor (no key): ask the peer for its region first")
        if len(data) != cls.SIZE:
            raise UsageError(f"remote region descriptor has {len(data)} bytes, expected {cls.SIZE} (truncated?)")
        base, length, key, crc = cls.FORMAT.unpack(data)
        if zlib.crc32(data[:24]) != crc:
            raise UsageError("remote region descriptor is corrupt (wrong key or length?): its checksum does not "
                             "match; use the descriptor exactly as the peer sent it")
        return cls(base, length, key)

    def check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise UsageError(f"write of {length} bytes at remote offset {offset} falls outside the peer's "
                             f"{self.length}-byte region")


def gpu_direct_verdict(provider: str, rc: int) -> tuple[bool | None, str]:
    """What fi_setopt(FI_OPT_CUDA_API_PERMITTED, false)'s return code says about GPUDirect RDMA (see
    Endpoint._forbid_cuda_api): 0 yes; -FI_EOPNOTSUPP no (the provider needs the CUDA API to move GPU
    memory); -FI_EINVAL no (no CUDA library or device); anything else, the provider does not say."""
    if rc == 0:
        return True, f"{provider} moves GPU memory without the CUDA API (GPUDirect RDMA)"
    if rc == -lib.FI_EOPNOTSUPP:
        return False, f"{provider} moves GPU memory only through the CUDA API (no GPUDirect RDMA: no dmabuf or " \
                      "nvidia-peermem)"
    if rc == -lib.FI_EINVAL:
        return False, f"{provider} sees no CUDA library or device"
    return None, f"{provider} does not answer the CUDA-API question ({errno_name(-rc)})"


def fresh_error_entry(entry):
    """The reused fi_cq_err_entry, ready for the next fi_cq_readerr: a provider may hand back error data of
    its own (efa does), into its own buffer when err_data_size is 0; a stale size and pointer left by the
    previous entry would have it write through them."""
    entry.err_data, entry.err_data_size = ffi.NULL, 0
    return entry


class Endpoint(Resource):
    """fi_endpoint bound to a completion queue (transmit and receive) and an address vector, enabled."""

    def __init__(self, domain: Domain, cq: CompletionQueue, av: AddressVector):
        super().__init__(domain)
        self.info = domain.info
        self.cq = cq
        self.av = av
        out = ffi.new("struct fid_ep **")
        check(_keeping_signal_handlers(lib.fi_endpoint, domain._ptr, self.info.ptr, out, ffi.NULL), "fi_endpoint")
        self._opened(out[0])
        check(lib.fi_ep_bind(self._ptr, cq._fid(), lib.FI_TRANSMIT | lib.FI_RECV), "fi_ep_bind(cq)")
        check(lib.fi_ep_bind(self._ptr, av._fid(), 0), "fi_ep_bind(av)")
        self.gpu_direct, self.gpu_direct_why = self._forbid_cuda_api() if self.info.hmem else (None, "")
        rc = _keeping_signal_handlers(lib.fi_enable, self._ptr)
        if rc == -_errno.EBUSY:
            # shm: a region left in /dev/shm by a killed process whose pid has come round again; the
            # failed enable removes it, so a second try succeeds
            rc = _keeping_signal_handlers(lib.fi_enable, self._ptr)
        check(rc, "fi_enable")
        _inprocess.endpoint_opened(self._native, self.name, (cq._native, av._native))
        self._msg = ffi.new("struct fi_msg_rma *")
        self._iov = ffi.new("struct iovec *")
        self._rma_iov = ffi.new("struct fi_rma_iov *")
        self._desc = ffi.new("void *[1]")
        self._msg.msg_iov = self._iov
        self._msg.desc = self._desc
        self._msg.iov_count = 1
        self._msg.rma_iov = self._rma_iov
        self._msg.rma_iov_count = 1

    def _forbid_cuda_api(self) -> tuple[bool | None, str]:
        """Whether GPU memory moves by GPUDirect RDMA on this endpoint: (True, ""), (False, why) or (None,
        why) where the provider does not say. Asked before fi_enable by forbidding the endpoint the CUDA
        API (FI_OPT_CUDA_API_PERMITTED, libfabric >= 1.18): a provider whose GPU support is cudaMemcpy
        through bounce buffers refuses, and GPU memory then goes through fabriclab's staged path, said as
        such, instead of a "direct" path that is a hidden copy (efa RDM without dmabuf or nvidia-peermem)."""
        if lib.FL_OPT_CUDA_API_PERMITTED < 0 or api_version() < fi_version(1, 18):
            return None, f"libfabric API {api_version() >> 16}.{api_version() & 0xFFFF} predates the CUDA-API check"
        permitted = ffi.new("bool *", False)
        rc = lib.fi_setopt(ffi.addressof(self._ptr[0], "fid"), lib.FI_OPT_ENDPOINT, lib.FL_OPT_CUDA_API_PERMITTED,
                           permitted, ffi.sizeof("bool"))
        return gpu_direct_verdict(self.info.provider, rc)

    @property
    def name(self) -> bytes:
        """The raw provider address of this endpoint (fi_getname)."""
        self._require_open()
        size = ffi.new("size_t *", 256)
        buf = ffi.new("char[]", 256)
        rc = lib.fi_getname(ffi.addressof(self._ptr[0], "fid"), buf, size)
        if rc == -lib.FI_ETOOSMALL:
            buf = ffi.new("char[]", size[0])
            rc = lib.fi_getname(ffi.addressof(self._ptr[0], "fid"), buf, size)
        check(rc, "fi_getname")
        return ffi.buffer(buf, size[0])[:]

    def address(self, max_message: int = 0) -> "Address":
        return Address(self.info.provider, self.info.addr_format, self.name, max_message)

    def declare_idle(self) -> None:
        """Say that no operation posted on this endpoint is still inside the provider (each reported its
        completion): its close then need not wait for the endpoints of this process it wrote to
        (fabriclab._inprocess says why it otherwise does)."""
        _inprocess.declare_idle(self._native)

    # Each post comes in two forms: try_post_* returns False on -FI_EAGAIN (the caller decides when to
    # retry) and post_* progresses this endpoint's completion queue and retries until its deadline. With
    # both peers in one process, use try_post_* and poll both queues: software providers also need the
    # peer to make progress before they accept the first message to it.

    def try_post_recv(self, mr: MemoryRegion, offset: int, length: int, token: Any,
                      source: int = None) -> bool:
        mr.check_range(offset, length)
        ctx = self.cq.new_context(token, mr)
        rc = lib.fi_recv(self._ptr, mr.pointer(offset), length, mr.desc,
                         lib.FI_ADDR_UNSPEC if source is None else source, ctx)
        return self._posted(rc, ctx, "fi_recv")

    def try_post_send(self, mr: MemoryRegion, offset: int, length: int, dest: int, token: Any) -> bool:
        mr.check_range(offset, length)
        if length > self.info.max_msg_size:
            raise UsageError(f"message of {length} bytes exceeds provider {self.info.provider}'s maximum of "
                             f"{self.info.max_msg_size} bytes")
        ctx = self.cq.new_context(token, mr)
        rc = lib.fi_send(self._ptr, mr.pointer(offset), length, mr.desc, dest, ctx)
        return self._posted(rc, ctx, "fi_send")

    def try_post_write(self, mr: MemoryRegion, offset: int, length: int, dest: int, remote: RemoteRegion,
                       remote_offset: int, token: Any, data: int | None = None, more: bool = False) -> bool:
        """RDMA WRITE ``length`` bytes at ``offset`` of ``mr`` into ``remote`` at ``remote_offset``;
        with ``data`` the target reads a completion carrying it (FI_REMOTE_CQ_DATA)."""
        mr.check_range(offset, length)
        remote.check_range(remote_offset, length)
        if data is not None and not 0 <= data < (1 << (8 * self.info.cq_data_size)):
            raise UsageError(f"immediate data {data} does not fit the provider's {self.info.cq_data_size}-byte "
                             "completion data")
        ctx = self.cq.new_context(token, mr)
        self._iov.iov_base = mr.pointer(offset)
        self._iov.iov_len = length
        self._desc[0] = mr.desc
        self._rma_iov.addr = remote.base + remote_offset
        self._rma_iov.len = length
        self._rma_iov.key = remote.key
        self._msg.addr = dest
        self._msg.context = ctx
        flags = lib.FI_COMPLETION
        if data is not None:
            self._msg.data = data
            flags |= lib.FI_REMOTE_CQ_DATA
        if more:
            flags |= lib.FI_MORE
        rc = lib.fi_writemsg(self._ptr, self._msg, flags)
        return self._posted(rc, ctx, "fi_writemsg")

    def _posted(self, rc: int, ctx, call: str) -> bool:
        if rc == 0:
            return True
        self.cq.forget_context(ctx)
        if rc == -lib.FI_EAGAIN:
            return False
        raise FabricError(call, rc)

    def _retry(self, attempt: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not attempt():
            self.cq.progress()
            if time.monotonic() > deadline:
                raise FabricTimeout(f"posting {what}", timeout, "the provider kept answering -FI_EAGAIN")

    def post_recv(self, mr, offset, length, token, source=None, timeout=DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_recv(mr, offset, length, token, source), "a receive", timeout)

    def post_send(self, mr, offset, length, dest, token, timeout=DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_send(mr, offset, length, dest, token), "a send", timeout)

    def post_write(self, mr, offset, length, dest, remote, remote_offset, token, data=None,
                   timeout=DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_write(mr, offset, length, dest, remote, remote_offset, token, data),
                    "a write", timeout)


# ----------------------------------------------------------------------------------------- addresses

_ADDR_MAGIC = b"FLAD"
_ADDR_HEADER = struct.Struct("<4sBBIQH")  # magic, version, provider name length, format, max message, raw len


@dataclass(frozen=True)
class Address:
    """An endpoint's address as fabriclab passes it between processes: the provider's raw address plus
    what a peer needs to check it fits (provider, address format) and, optionally, the largest message
    the endpoint has posted receives for. Printed and parsed as one hex line."""
    provider: str
    addr_format: int
    raw: bytes
    max_message: int = 0

    VERSION = 1

    def to_bytes(self) -> bytes:
        prov = self.provider.encode()
        return _ADDR_HEADER.pack(_ADDR_MAGIC, self.VERSION, len(prov), self.addr_format, self.max_message,
                                 len(self.raw)) + prov + self.raw

    def hex(self) -> str:
        return self.to_bytes().hex()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Address":
        if len(data) < _ADDR_HEADER.size:
            raise UsageError(f"truncated address: {len(data)} bytes, a fabriclab address has at least "
                             f"{_ADDR_HEADER.size} (copy the whole line the server printed)")
        magic, version, prov_len, fmt, max_message, raw_len = _ADDR_HEADER.unpack_from(data)
        if magic != _ADDR_MAGIC:
            raise UsageError("not a fabriclab address (it should be the hex line the server printed)")
        if version != cls.VERSION:
            raise UsageError(f"address version {version} is not understood by this fabriclab (expects {cls.VERSION})")
        need = _ADDR_HEADER.size + prov_len + raw_len
        if len(data) != need:
            raise UsageError(f"{'truncated' if len(data) < need else 'over-long'} address: {len(data)} bytes, "
                             f"expected {need} (copy the whole line the server printed)")
        prov = data[_ADDR_HEADER.size:_ADDR_HEADER.size + prov_len]
        try:
            provider = prov.decode()
        except UnicodeDecodeError:
            raise UsageError("malformed address: provider name is not text") from None
        addr = cls(provider, fmt, bytes(data[_ADDR_HEADER.size + prov_len:]), max_message)
        addr.check_format()
        return addr

    @classmethod
    def parse(cls, text: "str | bytes | Address") -> "Address":
        """Parse the hex line a server printed; every problem is a UsageError naming it."""
        if isinstance(text, Address):
            return text
        if isinstance(text, (bytes, bytearray)):
            return cls.from_bytes(bytes(text))
        if not isinstance(text, str):
            raise UsageError(f"an address is a hex string, not {type(text).__name__}")
        text = text.strip()
        if not text:
            raise UsageError("empty address: pass the hex line the server printed")
        bad = next((c for c in text if c not in string.hexdigits), None)
        if bad is not None:
            raise UsageError(f"malformed address: {bad!r} is not a hexadecimal digit")
        if len(text) % 2:
            raise UsageError("malformed address: odd number of hex digits (truncated when copied?)")
        return cls.from_bytes(bytes.fromhex(text))

    def check_format(self) -> None:
        """Check the raw address against its declared format (length, family, text)."""
        raw, fmt = self.raw, self.addr_format
        if not raw:
            raise UsageError("malformed address: the provider address is empty")
        if fmt == lib.FI_SOCKADDR_IN:
            if len(raw) < 16 or struct.unpack_from("<H", raw)[0] != socket.AF_INET:
                raise UsageError("malformed address: not an IPv4 socket address (FI_SOCKADDR_IN)")
        elif fmt == lib.FI_SOCKADDR_IN6:
            if len(raw) < 28 or struct.unpack_from("<H", raw)[0] != socket.AF_INET6:
                raise UsageError("malformed address: not an IPv6 socket address (FI_SOCKADDR_IN6)")
        elif fmt == lib.FI_ADDR_STR:
            body = raw.rstrip(b"\0")
            if not body or any(b < 0x20 or b > 0x7e for b in body):
                raise UsageError("malformed address: FI_ADDR_STR address is not printable text")

    def check_compatible(self, info: Info) -> None:
        if self.provider != info.provider:
            raise UsageError(f"address is for provider {self.provider!r} but this endpoint uses "
                             f"{info.provider!r}: start both sides with the same --provider")
        if self.addr_format != info.addr_format:
            raise UsageError(f"address format {_ADDR_FORMAT_NAMES.get(self.addr_format, self.addr_format)} does "
                             f"not match the local endpoint's {info.addr_format_name} (different domain or "
                             "address family on the two sides?)")

    def describe(self) -> str:
        fmt = _ADDR_FORMAT_NAMES.get(self.addr_format, str(self.addr_format))
        if self.addr_format == lib.FI_SOCKADDR_IN:
            port, ip = struct.unpack_from(">H4s", self.raw, 2)
            where = f"{socket.inet_ntoa(ip)}:{port}"
        elif self.addr_format == lib.FI_ADDR_STR:
            where = self.raw.rstrip(b"\0").decode(errors="replace")
        else:
            where = self.raw.hex()
        return f"{self.provider} {fmt} {where}"


# ------------------------------------------------------------------------------------- one endpoint


class EndpointStack:
    """Fabric → Domain → CQ + AV → Endpoint for one Info: what every stage opens per NIC.

    A context manager; closing it closes the whole tree. ``register`` adds memory regions to the domain.
    """

    def __init__(self, info: Info, cq_size: int = 0):
        self.info = info
        self.fabric = Fabric(info)
        try:
            self.domain = Domain(self.fabric, info)
            self.cq = CompletionQueue(self.domain, cq_size)
            self.av = AddressVector(self.domain)
            self.ep = Endpoint(self.domain, self.cq, self.av)
        except BaseException:
            self.fabric.close()
            raise

    def register(self, buffer=None, **kw) -> MemoryRegion:
        return MemoryRegion(self.domain, buffer, endpoint=self.ep, **kw)

    def close(self) -> None:
        self.fabric.close()

    @property
    def closed(self) -> bool:
        return self.fabric.closed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        _close_keeping(self, exc)
        return False


def _close_keeping(resource, pending: BaseException | None) -> None:
    """Close; when an exception is already on its way out, a failure to close (e.g. EBUSY after a
    timeout) must not replace it."""
    try:
        resource.close()
    except FabricError:
        if pending is None:
            raise


def open_endpoint(provider: str | None = None, domain: str | None = None, **kw) -> EndpointStack:
    """Open one endpoint on the first domain matching provider/domain (see getinfo)."""
    return EndpointStack(getinfo(provider, domain, **{k: v for k, v in kw.items() if k in ("caps", "hmem")})[0],
                         cq_size=kw.get("cq_size", 0))


def describe_tree(root: Resource) -> list[tuple[int, str]]:
    """(depth, label) pairs of a live resource tree, for drawing it."""
    out = []

    def walk(node: Resource, depth: int):
        label = type(node).__name__
        if isinstance(node, (Fabric, Domain)):
            label += f" {node.info.domain if isinstance(node, Domain) else node.info.fabric}"
        if isinstance(node, MemoryRegion):
            label += f" {node.length} B key={node.key:#x}"
        out.append((depth, label))
        for child in node.children:
            walk(child, depth + 1)

    walk(root, 0)
    return out
