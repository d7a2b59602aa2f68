from setuptools import setup

# cffi compiles native/ against the libfabric that native/build_ffi.py finds.
setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
