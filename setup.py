import pathlib
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "native"))
import build_ffi  # noqa: E402


class BuildWithProvider(build_ext):
    """The cffi extension, then the modeled-NIC libfabric provider beside it in the package (installed or
    in place for `pip install -e .`), where fabriclab.fi points FI_PROVIDER_PATH."""

    def run(self):
        super().run()
        package_dir = pathlib.Path(self.get_ext_fullpath("fabriclab._fabric")).parent
        package_dir.mkdir(parents=True, exist_ok=True)
        build_ffi.build_sim_provider(package_dir, self.compiler)


# cffi compiles native/ against the libfabric that native/build_ffi.py finds.
setup(cffi_modules=["native/build_ffi.py:ffibuilder"], cmdclass={"build_ext": BuildWithProvider})
