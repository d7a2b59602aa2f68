"""fabriclab: a course and a transfer engine for multi-NIC RDMA with libfabric.

``from fabriclab import Engine`` is the library. The package is layered, each layer importing only
from the ones below it (``tests/test_layers.py`` holds it to that):

* the binding: ``fi`` (libfabric through cffi) and ``_inprocess`` (the order in which endpoints of one
  process that are each other's peers may close);
* the library core: ``nics`` (NIC sets, worker placement), ``_native`` (the C engine's wrapper),
  ``memory``, ``gpu``, ``staging`` (GPU memory through pinned host memory), ``landing`` (staged GPU
  targets: landing lanes; its halves ``landing_target`` and ``landing_writer``), ``control`` (their control
  channel and its messages, checked), ``lanecopy`` (copying landed lanes into place), ``gpucopy`` (many copies
  in one CUDA launch), ``ipc`` (GPU regions offered to peers on this host through CUDA IPC; the writer's half,
  the ``cuda-ipc`` path, is ``ipc_writer``), ``topology``,
  ``recorded`` (recorded runs shipped as data), ``shmclean``, ``cli`` (command-line plumbing), ``measure`` (the
  one Gbps formula and the one verdict on interleaved runs), ``engine`` (``Engine``, ``Region``, ``Peer``: the
  public front) over its private machinery (``config``, ``errors``, ``transfer``, ``wire``, ``buffers``,
  ``pages``, ``service`` with ``completions``, ``renewal``, ``staged`` and ``submit_batch``), and
  ``bootstrap`` (exchanging descriptors);
* the course's stages, chapter by chapter, each importing the one before: ``unidirectional``,
  ``bidirectional``, ``rdma_write``, ``opqueue``, ``multi_nic``, ``threaded``, ``batched``;
* ``course`` (the notebooks' tooling) and ``tools`` (``bench``, ``testbed``, ``peers``, ``apidoc``).
"""
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the public names as the classes they are, for type checkers; at run time they load lazily
    from .engine import Engine as Engine, EngineConfig as EngineConfig, Peer as Peer, Region as Region
    from .engine import Transfer as Transfer, TransferResult as TransferResult
    from .errors import (InvalidDescriptor as InvalidDescriptor, OutOfRange as OutOfRange, PeerLost as PeerLost,
                         RegionClosed as RegionClosed, StagingFailed as StagingFailed, TransferError as TransferError,
                         TransferTimeout as TransferTimeout, WriteRejected as WriteRejected)
    from .fi import FabriclabError as FabriclabError, UsageError as UsageError

__version__ = "0.1.0"
_PUBLIC = ("Engine", "EngineConfig", "Region", "Peer", "Transfer", "TransferResult", "FabriclabError", "UsageError", "TransferError",
           "PeerLost", "WriteRejected", "TransferTimeout", "RegionClosed", "InvalidDescriptor", "OutOfRange",
           "StagingFailed")
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    # Lazy: the stages and tools need not load the engine.
    if name in _PUBLIC:
        return getattr(importlib.import_module("fabriclab.engine"), name)
    raise AttributeError(f"module 'fabriclab' has no attribute {name!r}")
