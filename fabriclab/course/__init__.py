"""The course's notebook tooling, on top of everything else: ``lesson`` (show a stage's source and its
diff, trace posts and completions), ``figures`` (the plots the lessons draw), ``tour`` (run every
lesson headless, print the measured figures beside the article's) and ``topo`` (the ``topo`` command,
which may draw a figure). Nothing below imports from here."""

from .. import nics as _nics

#: The lessons measure NICs: a provider's same-host shared-memory path (efa's) is turned off before
#: libfabric starts it, here and in every peer a lesson starts; lesson 01's doctor shows the setting.
SAME_HOST_SWITCHES_SET = _nics.measure_the_nics()

# The lessons may run on fabriclab's modeled p5 NICs (lesson 16, --provider sim): libfabric must be pointed
# at that provider before it starts, so it is here, on the course's import (never the default provider).
try:
    from .. import fi as _fi
    _fi.load_modeled_provider()
except _fi.UsageError:  # not built, or libfabric already started: asking for sim then says why
    pass
