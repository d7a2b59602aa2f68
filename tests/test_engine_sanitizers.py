"""AddressSanitizer and ThreadSanitizer builds of the native engine, run on a short transfer
(native/selftest: a target and a 2-thread batched, lazy, FI_MORE writer over shm in one process, counting
every write, then as the article's receiver)."""
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("build_ffi", ROOT / "native" / "build_ffi.py")


def libfabric_flags():
    build_ffi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_ffi)
    found = build_ffi.find_libfabric()
    return ([f"-I{d}" for d in found["include_dirs"]] + [f"-L{d}" for d in found["library_dirs"]]
            + [f"-Wl,-rpath,{d}" for d in found["runtime_library_dirs"]])


def sanitizer_runtime_missing(cc, sanitizer, tmp_path):
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    result = subprocess.run([cc, f"-fsanitize={sanitizer}", str(probe), "-o", str(tmp_path / "probe")],
                            capture_output=True, text=True)
    return result.returncode != 0 and result.stderr.strip().splitlines()[-1:]


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_engine_under_sanitizer(sanitizer, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    missing = sanitizer_runtime_missing(cc, sanitizer, tmp_path)
    if missing:
        pytest.skip(f"the compiler lacks the {sanitizer} sanitizer runtime: {missing}")
    binary = tmp_path / f"selftest-{sanitizer}"
    engine = [str(ROOT / "native" / name) for name in ("core.c", "course.c", "service.c")]
    build = subprocess.run([cc, "-O1", "-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer",
                            str(ROOT / "native" / "selftest" / "engine_selftest.c"), *engine,
                            *libfabric_flags(), "-lfabric", "-lpthread", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TSAN_OPTIONS": "halt_on_error=1",
                              "ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine selftest: 257 writes, ok" in run.stdout
    assert "engine selftest, last writes marked: 257 writes, 4 marks, ok" in run.stdout
    assert "WARNING: ThreadSanitizer" not in run.stderr and "ERROR: AddressSanitizer" not in run.stderr
