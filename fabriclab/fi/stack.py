"""One endpoint's whole tree (``EndpointStack``: fabric, domain, queues, endpoint) as every stage opens it
per NIC, and ``describe_tree`` for drawing a live tree."""
from __future__ import annotations

from types import TracebackType
from typing import Any, Literal

from ._core import Resource, close_keeping
from .av import AddressVector
from .constants import DEFAULT_CAPS
from .cq import CompletionQueue
from .endpoint import Endpoint
from .fabric import Domain, Fabric
from .info import Info, getinfo
from .mr import MemoryRegion


class EndpointStack:
    """Fabric → Domain → CQ + AV → Endpoint for one Info: what every stage opens per NIC.

    A context manager; closing it closes the whole tree. ``register`` adds memory regions to the domain.
    """

    def __init__(self, info: Info, cq_size: int = 0) -> None:
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

    def register(self, buffer: object = None, **kw: Any) -> MemoryRegion:
        """Register memory in this stack's domain, bound to its endpoint where the provider asks (see
        MemoryRegion for the keywords)."""
        return MemoryRegion(self.domain, buffer, endpoint=self.ep, **kw)

    def close(self) -> None:
        self.fabric.close()

    @property
    def closed(self) -> bool:
        return self.fabric.closed

    def __enter__(self) -> EndpointStack:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        close_keeping(self, exc)
        return False


def open_endpoint(provider: str | None = None, domain: str | None = None, *, caps: int = DEFAULT_CAPS,
                  hmem: bool | None = False, cq_size: int = 0) -> EndpointStack:
    """Open one endpoint on the first domain matching provider/domain (see getinfo)."""
    return EndpointStack(getinfo(provider, domain, caps=caps, hmem=hmem)[0], cq_size=cq_size)


def describe_tree(root: Resource) -> list[tuple[int, str]]:
    """(depth, label) pairs of a live resource tree, for drawing it."""
    out: list[tuple[int, str]] = []

    def walk(node: Resource, depth: int) -> None:
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
