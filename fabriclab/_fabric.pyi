"""Type stub for the cffi module native/build_ffi.py builds (fabriclab/_fabric.abi3.so): libfabric's
structs, functions and constants (native/fabric_cdef.h) and fabriclab's C engine (``fl_*``).

cffi builds its ``ffi`` and ``lib`` objects at run time from C declarations, so their attributes cannot be
spelled out here without copying fabric_cdef.h: both are ``Any``. Code over them gives its own hints at
the Python boundary (``int(...)`` of a C integer, ``str`` of a C string)."""
from typing import Any

ffi: Any
lib: Any
