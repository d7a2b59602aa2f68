"""Shared test fixtures: the providers every end-to-end test runs over (loopback only for tcp)."""
import os

import pytest

from fabriclab import fi
from fabriclab.tools.peers import start_server

# tcp is pinned to the loopback interface: tests never send traffic to any other address.
PROVIDERS = [("shm", None), ("tcp;ofi_rxm", "lo")]


def provider_args(provider, domain):
    return ["--provider", provider] + (["--domain", domain] if domain else [])


@pytest.fixture(params=PROVIDERS, ids=[p for p, _ in PROVIDERS])
def fabric(request):
    """(provider, domain) pairs; skipped where the provider is not available here."""
    return available(request.param)


def available(fabric):
    """``fabric`` ((provider, domain)) as it is, or the test skipped where its provider is not available here."""
    if fabric[0] not in fi.available_providers():
        pytest.skip(f"provider {fabric[0]} is not available here")
    return fabric


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def shared_target(module: str, *args: str, fabrics=PROVIDERS, ids=None, env=None):
    """A module-scoped fixture: one ``module`` target process per fabric (``python -m module``, with ``args`` and
    ``env(fabric)`` added to its environment), shared by the test module's tests as (fabric, server), as a target
    serves one writer after another; starting one for each test cost each some 0.7 s."""
    @pytest.fixture(scope="module", params=fabrics, ids=ids or [p for p, _ in fabrics])
    def target(request):
        fabric = available(request.param)
        with start_server(module, *provider_args(*fabric), *args, env=env(fabric) if env else None) as server:
            yield fabric, server
    return target


# The modeled NICs (provider sim) must be on libfabric's path before its first initialisation in this
# process; it is never the default provider, so the other tests see the same providers as before.
fi.load_modeled_provider()
