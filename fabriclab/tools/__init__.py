"""Tools built on the library and the stages: ``bench`` (the one benchmark harness; the bench_* modules
behind it), ``testbed`` (the small p5: network namespaces joined by shaped links; ``netns``, ``reaper`` and
the testbed_* modules behind it), ``peers`` (start a stage's server in another
process, here, over ssh or under a launcher) and ``apidoc`` (the API reference from the docstrings).
Neither the library nor the stages import from here."""
