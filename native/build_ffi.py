"""cffi (API mode) build of fabriclab._fabric against the system libfabric.

libfabric is looked for, in order, under $FABRICLAB_LIBFABRIC_PREFIX, /opt/amazon/efa (the EFA
installer's layout on AWS), `pkg-config libfabric`, and the compiler's default paths.
"""
import os
import pathlib
import shlex
import subprocess
import sys

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
HEADER = "rdma/fabric.h"
MISSING_HEADERS = (
    "fabriclab: libfabric headers (rdma/fabric.h) were not found.\n"
    "  Debian/Ubuntu:  apt-get install libfabric-dev libfabric-bin\n"
    "  AWS EFA hosts:  run the EFA installer (it puts libfabric under /opt/amazon/efa)\n"
    "  elsewhere:      set FABRICLAB_LIBFABRIC_PREFIX to the prefix holding include/rdma/fabric.h"
)


def _prefix_flags(prefix):
    prefix = pathlib.Path(prefix)
    include = prefix / "include"
    if not (include / HEADER).is_file():
        return None
    libdirs = [str(d) for d in (prefix / "lib64", prefix / "lib", prefix / "lib" / "x86_64-linux-gnu") if d.is_dir()]
    return {"include_dirs": [str(include)], "library_dirs": libdirs, "runtime_library_dirs": libdirs}


def _pkg_config_flags():
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "libfabric"], capture_output=True, text=True, check=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "libfabric"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    includes = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    libdirs = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    if includes and not any((pathlib.Path(i) / HEADER).is_file() for i in includes):
        return None
    if not includes and not pathlib.Path("/usr/include", HEADER).is_file():
        return None
    return {"include_dirs": includes, "library_dirs": libdirs, "runtime_library_dirs": libdirs}


def _default_flags():
    for root in ("/usr/include", "/usr/local/include"):
        if (pathlib.Path(root) / HEADER).is_file():
            return {"include_dirs": [], "library_dirs": [], "runtime_library_dirs": []}
    return None


def find_libfabric():
    """Compiler flags for the first libfabric found, or SystemExit naming how to install it."""
    env_prefix = os.environ.get("FABRICLAB_LIBFABRIC_PREFIX")
    if env_prefix:
        flags = _prefix_flags(env_prefix)
        if flags is None:
            sys.exit(f"fabriclab: FABRICLAB_LIBFABRIC_PREFIX={env_prefix} has no include/{HEADER}\n" + MISSING_HEADERS)
        return flags
    for finder in (lambda: _prefix_flags("/opt/amazon/efa"), _pkg_config_flags, _default_flags):
        flags = finder()
        if flags is not None:
            return flags
    sys.exit(MISSING_HEADERS)


#: The modeled-NIC provider (native/sim), a libfabric DL provider: libfabric loads `lib<name>-fi.so` files
#: from $FI_PROVIDER_PATH, and fabriclab points it at the package's directory when the provider is asked for.
SIM_PROVIDER = "libsim-fi.so"


def build_sim_provider(output_dir, compiler=None) -> pathlib.Path:
    """Compile native/sim/*.c into ``output_dir``/libsim-fi.so with the compiler setuptools uses. Only
    fi_prov_ini leaves the library (-fvisibility=hidden): the provider's sim_* names stay its own."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler
    if compiler is None:
        compiler = new_compiler()
        customize_compiler(compiler)
    flags = find_libfabric()
    output_dir = pathlib.Path(output_dir)
    build_dir = HERE / "sim" / "build"
    sources = sorted(HERE.glob("sim/*.c"))
    objects = compiler.compile([str(p) for p in sources], output_dir=str(build_dir),
                               include_dirs=flags["include_dirs"], extra_preargs=["-fPIC", "-fvisibility=hidden"],
                               depends=[str(p) for p in HERE.glob("sim/*.h")],
                               extra_postargs=["-O2", "-Wall", "-Wno-unused-parameter"])
    target = output_dir / SIM_PROVIDER
    compiler.link_shared_object(objects, str(target), libraries=["fabric"], library_dirs=flags["library_dirs"],
                                runtime_library_dirs=flags["runtime_library_dirs"])
    return target


ffibuilder = FFI()
ffibuilder.cdef((HERE / "fabric_cdef.h").read_text())
ffibuilder.set_source(
    "fabriclab._fabric",
    '#include "fabriclab_native.h"\n#include "signals.h"\n#include "gate.h"\n',
    sources=[str(p.relative_to(HERE.parent)) for p in sorted(HERE.glob("*.c"))],
    libraries=["fabric", "pthread"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
    **{k: v + ([str(HERE)] if k == "include_dirs" else []) for k, v in find_libfabric().items()},
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    print("built", build_sim_provider(HERE.parent / "fabriclab"))
