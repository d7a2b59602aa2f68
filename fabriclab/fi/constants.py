"""libfabric's constants as fabriclab uses them: the capabilities, modes and access it asks for, the names
of flag bits for printing, and the API version. The first module of the binding to load the cffi module, so
the environment libfabric's providers read is set here, before it loads."""
from __future__ import annotations

import os

# libfabric's psm providers load libinfinipath, which installs its own SIGINT/SIGTERM/SIGSEGV handlers
# that end the process without Python's cleanup (no KeyboardInterrupt) unless told not to.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
os.environ.setdefault("HFI_NO_BACKTRACE", "1")

# Re-exported: the binding's modules take them from here, after the environment above is set.
from .._fabric import ffi as ffi, lib as lib  # noqa: E402

#: Providers in the order fabriclab prefers them when none is named: real RDMA NICs first, then the
#: shared-memory provider (two processes on one host), then TCP (any network, loopback included).
PREFERRED_PROVIDERS = ("efa", "verbs;ofi_rxm", "shm", "tcp;ofi_rxm")
DEFAULT_TIMEOUT = 10.0

DEFAULT_CAPS: int = lib.FI_MSG | lib.FI_RMA
#: Bytes of immediate data every write carries (a page's or write's sequence number, lesson 06): the hints
#: ask for at least this ``cq_data_size``, so a fabric offering less (some efa-direct releases offer 0) is
#: never chosen, instead of failing at the first write.
IMMEDIATE_DATA_BYTES: int = 4
# The registration modes fabriclab knows how to honour; the provider picks the ones it needs.
SUPPORTED_MR_MODES: int = (lib.FI_MR_LOCAL | lib.FI_MR_VIRT_ADDR | lib.FI_MR_ALLOCATED | lib.FI_MR_PROV_KEY
                           | lib.FI_MR_ENDPOINT | lib.FI_MR_HMEM)
SUPPORTED_MODES: int = lib.FI_CONTEXT | lib.FI_CONTEXT2
ACCESS_ALL: int = (lib.FI_SEND | lib.FI_RECV | lib.FI_READ | lib.FI_WRITE | lib.FI_REMOTE_READ
                   | lib.FI_REMOTE_WRITE)
# What memory that is only ever the source of this side's writes and sends must allow (read-only buffers).
ACCESS_SOURCE: int = lib.FI_WRITE | lib.FI_SEND

_MR_MODE_NAMES: dict[int, str] = {
    lib.FI_MR_LOCAL: "FI_MR_LOCAL", lib.FI_MR_RAW: "FI_MR_RAW", lib.FI_MR_VIRT_ADDR: "FI_MR_VIRT_ADDR",
    lib.FI_MR_ALLOCATED: "FI_MR_ALLOCATED", lib.FI_MR_PROV_KEY: "FI_MR_PROV_KEY",
    lib.FI_MR_MMU_NOTIFY: "FI_MR_MMU_NOTIFY", lib.FI_MR_RMA_EVENT: "FI_MR_RMA_EVENT",
    lib.FI_MR_ENDPOINT: "FI_MR_ENDPOINT", lib.FI_MR_HMEM: "FI_MR_HMEM"}
_MODE_NAMES: dict[int, str] = {
    lib.FI_CONTEXT: "FI_CONTEXT", lib.FI_CONTEXT2: "FI_CONTEXT2", lib.FI_RX_CQ_DATA: "FI_RX_CQ_DATA",
    lib.FI_LOCAL_MR: "FI_LOCAL_MR", lib.FI_MSG_PREFIX: "FI_MSG_PREFIX"}
_ADDR_FORMAT_NAMES: dict[int, str] = {
    lib.FI_FORMAT_UNSPEC: "FI_FORMAT_UNSPEC", lib.FI_SOCKADDR: "FI_SOCKADDR", lib.FI_SOCKADDR_IN: "FI_SOCKADDR_IN",
    lib.FI_SOCKADDR_IN6: "FI_SOCKADDR_IN6", lib.FI_SOCKADDR_IB: "FI_SOCKADDR_IB", lib.FI_ADDR_PSMX: "FI_ADDR_PSMX",
    lib.FI_ADDR_GNI: "FI_ADDR_GNI", lib.FI_ADDR_BGQ: "FI_ADDR_BGQ", lib.FI_ADDR_MLX: "FI_ADDR_MLX",
    lib.FI_ADDR_STR: "FI_ADDR_STR", lib.FI_ADDR_PSMX2: "FI_ADDR_PSMX2", lib.FI_ADDR_IB_UD: "FI_ADDR_IB_UD",
    lib.FI_ADDR_EFA: "FI_ADDR_EFA"}
_ERRNO_NAMES: dict[int, str] = {getattr(lib, n): n for n in dir(lib)
                                if n.startswith("FI_E") and isinstance(getattr(lib, n), int)
                                and n not in ("FI_EP_MSG", "FI_EP_DGRAM", "FI_EP_RDM")}


def fi_version(major: int, minor: int) -> int:
    """FI_VERSION(major, minor) of rdma/fabric.h."""
    return (major << 16) | minor


def api_version() -> int:
    """The newest API version both this build's headers and the loaded library speak."""
    return min(int(lib.fi_version()), fi_version(lib.FI_MAJOR_VERSION, lib.FI_MINOR_VERSION))


def library_version() -> str:
    """The loaded libfabric's version, "major.minor"."""
    v = lib.fi_version()
    return f"{v >> 16}.{v & 0xFFFF}"


def flag_names(value: int, names: dict[int, str]) -> list[str]:
    """The names of the bits set in ``value``."""
    return [name for bit, name in names.items() if value & bit]
