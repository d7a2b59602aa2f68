"""Building native test programs against the libfabric the package was built with, optionally under a sanitizer
(the engine's sanitizer tests, the modeled-NIC provider's conformance tests)."""
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("build_ffi", ROOT / "native" / "build_ffi.py")


def libfabric_flags() -> list[str]:
    build_ffi = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(build_ffi)
    found = build_ffi.find_libfabric()
    return ([f"-I{d}" for d in found["include_dirs"]] + [f"-L{d}" for d in found["library_dirs"]]
            + [f"-Wl,-rpath,{d}" for d in found["runtime_library_dirs"]])


def sanitizer_runtime_missing(cc: str, sanitizer: str, tmp_path: pathlib.Path):
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    result = subprocess.run([cc, f"-fsanitize={sanitizer}", str(probe), "-o", str(tmp_path / "probe")],
                            capture_output=True, text=True)
    return result.returncode != 0 and result.stderr.strip().splitlines()[-1:]


def compiler_with(sanitizer: str | None, tmp_path: pathlib.Path) -> str:
    """The C compiler, with the sanitizer's runtime; skips the test where either is missing."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    missing = sanitizer and sanitizer_runtime_missing(cc, sanitizer, tmp_path)
    if missing:
        pytest.skip(f"the compiler lacks the {sanitizer} sanitizer runtime: {missing}")
    return cc


def sanitizer_flags(sanitizer: str | None) -> list[str]:
    return ["-O1", "-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"] if sanitizer else ["-O2", "-g"]


SANITIZER_ENV = {"TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"}


def sanitizer_reported(stderr: str) -> bool:
    return "WARNING: ThreadSanitizer" in stderr or "ERROR: AddressSanitizer" in stderr
