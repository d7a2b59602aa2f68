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

One module per object family, as pyverbs has one per verbs object: ``info`` (fi_getinfo), ``fabric``
(fabric and domain), ``cq``, ``av`` (addresses), ``mr``, ``endpoint``, ``stack`` (one endpoint's whole tree),
``errors`` and ``constants``, over the private ``_core`` (resource tree, fork, signal handlers). Everything
public is re-exported here: ``from fabriclab import fi`` and ``fi.Endpoint``, ``fi.getinfo``...
"""
from __future__ import annotations

# constants first: it sets the environment libfabric's providers read, then loads the cffi module.
from .constants import (ACCESS_ALL, ACCESS_SOURCE, DEFAULT_CAPS, DEFAULT_TIMEOUT, IMMEDIATE_DATA_BYTES,
                        PREFERRED_PROVIDERS, SUPPORTED_MODES, SUPPORTED_MR_MODES, api_version, ffi, fi_version,
                        flag_names, lib, library_version)
from .errors import FabricError, FabriclabError, FabricTimeout, UsageError, check, errno_name, integer, seconds
from ._core import Resource, signals_given_back, stop_first_at_exit
from .info import (IP_PROVIDERS, LOOPBACK, MODELED_PROVIDER, MODELED_PROVIDER_LIBRARY, Info, Nic, _hints,
                   available_providers, default_provider, domains, getinfo, load_modeled_provider,
                   modeled_provider_loaded, one_fabric_per_nic, provider_fabric_first, same_host_fabric)
from .fabric import Domain, Fabric
from .cq import Completion, CompletionQueue, fresh_error_entry
from .av import Address, AddressVector, AddressVectorFull
from .mr import MemoryRegion, RemoteRegion
from .endpoint import Endpoint, gpu_direct_verdict
from .stack import EndpointStack, describe_tree, open_endpoint

__all__ = [
    # constants
    "ACCESS_ALL", "ACCESS_SOURCE", "DEFAULT_CAPS", "DEFAULT_TIMEOUT", "IMMEDIATE_DATA_BYTES", "PREFERRED_PROVIDERS",
    "SUPPORTED_MODES", "SUPPORTED_MR_MODES", "api_version", "ffi", "fi_version", "flag_names", "lib",
    "library_version",
    # errors
    "FabricError", "FabriclabError", "FabricTimeout", "UsageError", "check", "errno_name", "integer", "seconds",
    # shared machinery
    "Resource", "signals_given_back", "stop_first_at_exit",
    # fi_getinfo
    "IP_PROVIDERS", "LOOPBACK", "MODELED_PROVIDER", "MODELED_PROVIDER_LIBRARY", "Info", "Nic", "_hints",
    "available_providers", "default_provider", "domains", "getinfo", "load_modeled_provider",
    "modeled_provider_loaded", "one_fabric_per_nic", "provider_fabric_first", "same_host_fabric",
    # the objects
    "Domain", "Fabric", "Completion", "CompletionQueue", "fresh_error_entry", "Address", "AddressVector",
    "AddressVectorFull", "MemoryRegion", "RemoteRegion", "Endpoint", "gpu_direct_verdict", "EndpointStack",
    "describe_tree", "open_endpoint",
]
