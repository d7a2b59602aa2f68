"""Tools built on the library and the stages: ``bench`` (the one benchmark harness), ``testbed`` (the
small p5: network namespaces joined by shaped links), ``peers`` (start a stage's server in another
process, here, over ssh or under a launcher) and ``apidoc`` (the API reference from the docstrings).
Neither the library nor the stages import from here."""
