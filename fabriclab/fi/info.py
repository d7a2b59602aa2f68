"""fi_getinfo: which providers and domains (NICs) are here, what each offers (``Info``), which one to use
(``getinfo``, ``domains``, ``default_provider``), and the modeled NICs' provider (``sim``), which libfabric
must be pointed at before it starts."""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

from ._core import CData, cstr, keeping_signal_handlers
from .constants import (_ADDR_FORMAT_NAMES, _MODE_NAMES, _MR_MODE_NAMES, DEFAULT_CAPS, IMMEDIATE_DATA_BYTES,
                        PREFERRED_PROVIDERS, SUPPORTED_MODES, SUPPORTED_MR_MODES, api_version, ffi, flag_names, lib)
from .errors import FabricError, UsageError, check

@dataclass(frozen=True)
class Nic:
    """What fi_getinfo says about the NIC behind a domain (all optional: software providers say little)."""
    name: str | None
    pci: str | None
    link_speed_bps: int | None
    link_state: str | None
    mtu: int | None

    def describe(self) -> str:
        """One line: name, PCI address, link speed (those known)."""
        parts = [self.name or "?"]
        if self.pci:
            parts.append(f"pci {self.pci}")
        if self.link_speed_bps:
            parts.append(f"link {self.link_speed_bps / 1e9:g} Gbps")
        return ", ".join(parts)


class _InfoList:
    """Owns one fi_getinfo result and frees it when nothing refers to it any more."""

    def __init__(self, head: CData) -> None:
        self.head = head
        # never at interpreter exit: objects opened from it may still be open then, and close after it
        # (fi._core's exit order); the process's end frees the memory anyway
        weakref.finalize(self, lib.fi_freeinfo, head).atexit = False


class Info:
    """One fi_info entry: a provider on a domain (a NIC), with the attributes fabriclab relies on."""

    def __init__(self, owner: _InfoList, ptr: CData) -> None:
        self._owner = owner
        self.ptr = ptr
        d, f, ep, tx, rx = ptr.domain_attr, ptr.fabric_attr, ptr.ep_attr, ptr.tx_attr, ptr.rx_attr
        # fi_getinfo names the provider, fabric and domain of every entry it returns
        self.provider: str = cstr(f.prov_name) or ""
        self.fabric: str = cstr(f.name) or ""
        self.domain: str = cstr(d.name) or ""
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
    def _nic(nic: CData) -> Nic | None:
        if nic == ffi.NULL:
            return None
        name: str | None = None
        pci: str | None = None
        state: str | None = None
        speed: int | None = None
        mtu: int | None = None
        if nic.device_attr != ffi.NULL:
            name = cstr(nic.device_attr.name)
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
        return self.fabric.startswith("modeled-")

    @property
    def moves_payload(self) -> bool:
        """Whether written bytes reach the target: every real provider; the model only in payload mode
        (fabric ``modeled-...-payload``, FABRICLAB_SIM_PAYLOAD=1)."""
        return not self.modeled or self.fabric.endswith("-payload")

    @property
    def prov_key(self) -> bool:
        return bool(self.mr_mode & lib.FI_MR_PROV_KEY)

    def __repr__(self) -> str:
        return f"<Info provider={self.provider!r} domain={self.domain!r} fabric={self.fabric!r}>"


def _hints(provider: str | None, caps: int, ep_type: int, cq_data_size: int = 0) -> CData:
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
# Built into the package directory (fabriclab/), beside the cffi module.
MODELED_PROVIDER_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "libsim-fi.so")
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
        rc = keeping_signal_handlers(lib.fi_getinfo, api_version(), ffi.NULL, ffi.NULL, 0, hints, out)
    finally:
        lib.fi_freeinfo(hints)
    if rc == -lib.FI_ENODATA:
        return []
    check(rc, f"fi_getinfo(provider={provider!r})")
    owner = _InfoList(out[0])
    infos: list[Info] = []
    seen: set[tuple[str, str, str, int]] = set()
    p = out[0]
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
    seen: list[str] = []
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
            known = sorted({i.domain for i in infos})
            raise UsageError(f"provider {provider!r} has no domain {domain!r}; its domains here: {', '.join(known)}")
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
