"""fabriclab: a course and a transfer engine for multi-NIC RDMA with libfabric.

``from fabriclab import Engine`` is the library; the stage modules (``fabriclab.unidirectional`` …
``fabriclab.batched``) are the course's steps.
"""
import importlib

__version__ = "0.1.0"
_PUBLIC = ("Engine", "Region", "Peer", "Transfer", "TransferResult", "FabriclabError", "UsageError", "TransferError",
           "PeerLost", "WriteRejected", "TransferTimeout", "RegionClosed", "InvalidDescriptor", "OutOfRange")
__all__ = list(_PUBLIC)


def __getattr__(name):
    # Lazy: the stages and tools need not load the engine.
    if name in _PUBLIC:
        return getattr(importlib.import_module("fabriclab.engine"), name)
    raise AttributeError(f"module 'fabriclab' has no attribute {name!r}")
