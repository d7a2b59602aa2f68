"""The course's notebook tooling, on top of everything else: ``lesson`` (show a stage's source and its
diff, trace posts and completions), ``figures`` (the plots the lessons draw) and ``tour`` (run every
lesson headless, print the measured figures beside the article's). Nothing below imports from here."""

from .. import nics as _nics

#: The lessons measure NICs: a provider's same-host shared-memory path (efa's) is turned off before
#: libfabric starts it, here and in every peer a lesson starts; lesson 01's doctor shows the setting.
SAME_HOST_SWITCHES_SET = _nics.measure_the_nics()
