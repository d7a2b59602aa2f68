"""``fabriclab.EngineConfig``: everything an Engine is built from, in one frozen object, validated once.

    config = EngineConfig("shm", nics=4, threads=2, timeout=10)
    with Engine(config=config) as engine:       # or the shortcut: Engine("shm", nics=4, threads=2, timeout=10)
        engine.stats()["layout"]["config"]       # what it was built from (also in repr(engine))

Every bad value is refused here, before any NIC opens, with an error naming the value and what would do.
Values left out (None) are chosen by the engine for the host (``fabriclab.nics.default_layout``): its
``stats()["layout"]`` says what was chosen and why."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from . import _native, fi, staging


@dataclass(frozen=True, repr=False)
class EngineConfig:
    """An Engine's configuration, validated once (each bad value is refused with what would do). Frozen;
    ``dataclasses.replace`` makes a changed copy, validated again. Its repr shows the values that differ from
    the defaults.

    ``provider``/``domains``/``nics`` pick the NICs and ``threads`` the worker threads; left out, they
    suit the host (``fabriclab.nics.default_layout``): every real NIC and a thread per topology group
    (GPU) where there are several NICs; on a provider with one domain (shm, tcp on one interface) a thread
    per spare core (one core left to the caller; at most 8) and an emulated NIC slot per thread. ``nics``
    above the real count adds emulated NICs. The engine's repr and ``stats()["layout"]`` say what was
    chosen. Each GPU's NICs go to one worker (``fabriclab.nics.group_nics``), pinned to a core
    fabriclab.topology proposes near them (two pinned engines on one host would share those cores: give
    one ``pin=False``). Workers post lazily, ``batch`` writes from their inbox per NIC per pass, at most
    ``in_flight`` writes in flight per NIC (default: what the provider's queue takes); ``fi_more`` is
    chapter 15's FI_MORE.

    ``timeout`` is every transfer's default deadline in seconds; a NIC with writes in flight and no
    completion for ``link_timeout`` seconds (default a third of ``timeout``, ``link_timeout_s`` says; 0:
    never) no longer reaches those writes' peers: they go over the other NICs (failover; ``Engine.stats()`` names
    the NIC) and fail with PeerLost when no NIC reaches the peer. ``gpu`` (default: when CUDA is here)
    opens the NICs able to register GPU memory (on shm that variant moves host memory more slowly: say
    ``gpu=False`` when you only move host memory). ``gpu_ipc`` (default True): GPU regions are offered to
    writers on this host, and writes from GPU memory into a peer's GPU region on this host are copied by the
    GPU through CUDA IPC where the peer's memory opens here (``fabriclab.ipc``; ``Peer.route`` says which path
    a pair takes and why); False keeps both to the NICs and the staged path.

    GPU memory the provider cannot register is staged (``fabriclab.staging``): ``staging_bytes`` (default
    64 MiB) bounds the engine's pinned pool; ``staging_chunk_bytes`` (default 4 MiB, at least 4096) is one
    copy's size, and the largest page or stripe a staged transfer can carry. A staged target's landing
    lanes (``fabriclab.landing``) take the same sizes. The pool must hold two chunks."""
    provider: str | None = None
    nics: int | None = None
    domains: tuple[str, ...] | None = None  # a comma-separated string or a list is taken too
    threads: int | None = None
    pin: bool = True
    batch: int = 16
    fi_more: bool = False
    timeout: float = 30.0
    in_flight: int | None = None
    gpu: bool | None = None
    gpu_ipc: bool = True
    link_timeout: float | None = None
    staging_bytes: int = staging.DEFAULT_STAGING_BYTES
    staging_chunk_bytes: int = staging.DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        timeout = fi.seconds(self.timeout, "timeout")
        link = None if self.link_timeout is None else fi.seconds(self.link_timeout, "link_timeout",
                                                                 zero_means="failover off")
        valid: dict[str, Any] = {
            "timeout": timeout, "link_timeout": link,
            "nics": None if self.nics is None else fi.integer(self.nics, "nics", 1, _native.MAX_NICS),
            "threads": None if self.threads is None else fi.integer(self.threads, "threads", 1, _native.MAX_THREADS),
            "batch": fi.integer(self.batch, "batch", 1, _native.MAX_BATCH),
            "in_flight": None if self.in_flight is None else fi.integer(self.in_flight, "in_flight", 1),
            "staging_chunk_bytes": fi.integer(self.staging_chunk_bytes, "staging_chunk_bytes", 4096),
            "staging_bytes": fi.integer(self.staging_bytes, "staging_bytes", 1),
            "domains": _domains(self.domains), "pin": bool(self.pin), "fi_more": bool(self.fi_more),
            "gpu": None if self.gpu is None else bool(self.gpu), "gpu_ipc": bool(self.gpu_ipc)}
        staging.pool_layout(valid["staging_bytes"], valid["staging_chunk_bytes"])  # a pool that cannot stream
        for name, value in valid.items():
            object.__setattr__(self, name, value)

    @property
    def link_timeout_s(self) -> float:
        """The link timeout in effect: ``link_timeout``, or a third of ``timeout`` when left out (0: never)."""
        return self.timeout / 3 if self.link_timeout is None else self.link_timeout

    def as_dict(self) -> dict[str, Any]:
        """Every value, by name (``domains`` as a list)."""
        values = dataclasses.asdict(self)
        values["domains"] = None if self.domains is None else list(self.domains)
        return values

    def __repr__(self) -> str:
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return f"EngineConfig({', '.join(given)})"


class EngineOptions(TypedDict, total=False):
    """``Engine(provider, **options)``'s keywords, typed: the fields of :class:`EngineConfig` but the provider
    (tests/test_types.py checks that the two lists agree)."""
    nics: int | None
    domains: str | Sequence[str] | None
    threads: int | None
    pin: bool
    batch: int
    fi_more: bool
    timeout: float
    in_flight: int | None
    gpu: bool | None
    gpu_ipc: bool
    link_timeout: float | None
    staging_bytes: int
    staging_chunk_bytes: int


def _domains(domains: object) -> tuple[str, ...] | None:
    """Domain names as a tuple: from a comma-separated string, or any iterable of names."""
    if domains is None:
        return None
    if isinstance(domains, str):
        return tuple(d for d in domains.split(",") if d)
    names = tuple(domains) if isinstance(domains, Iterable) else None
    if names is None or not all(isinstance(d, str) for d in names):
        raise fi.UsageError(f"domains must be domain names (a list, or one string separated by commas), "
                            f"got {domains!r}")
    return names
