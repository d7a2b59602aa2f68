"""AddressSanitizer and ThreadSanitizer builds of the native engine, run on a short transfer
(native/selftest: a target and a 2-thread batched, lazy, FI_MORE writer over shm in one process)."""
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


def sanitized_build(sanitizer, selftest, tmp_path):
    """native/selftest/``selftest``.c built with the engine under ``sanitizer`` (None: optimised, as the module
    is built), skipping where that cannot be."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    missing = sanitizer and sanitizer_runtime_missing(cc, sanitizer, tmp_path)
    if missing:
        pytest.skip(f"the compiler lacks the {sanitizer} sanitizer runtime: {missing}")
    binary = tmp_path / f"{selftest}-{sanitizer}"
    engine = [str(ROOT / "native" / name) for name in ("core.c", "course.c", "service.c", "imm.c")]
    flags = ["-O1", "-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"] if sanitizer else ["-O2"]
    build = subprocess.run([cc, *flags,
                            str(ROOT / "native" / "selftest" / f"{selftest}.c"), *engine,
                            *libfabric_flags(), "-lfabric", "-lpthread", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary


def run_sanitized(binary, *args):
    run = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TSAN_OPTIONS": "halt_on_error=1",
                              "ASAN_OPTIONS": "detect_leaks=1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING: ThreadSanitizer" not in run.stderr and "ERROR: AddressSanitizer" not in run.stderr
    return run


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_engine_under_sanitizer(sanitizer, tmp_path):
    run = run_sanitized(sanitized_build(sanitizer, "engine_selftest", tmp_path))
    assert "engine selftest: 257 writes, ok" in run.stdout


@pytest.mark.parametrize("sanitizer, values", [("address", 20000), ("thread", 20000), (None, 300000)])
def test_immediate_counts_under_sanitizer(sanitizer, values, tmp_path):
    """Issue 21, item 3: two threads count the pages of ``values`` arrivals as they land while a third awaits,
    takes and gives back each, through a table of 64 slots; one value's pages land in step with an expect()
    after another that takes each and gives its slot back at once: every page counted once, every slot back, a
    full table refusing and reporting what it could not count; no data race, no leak. (Optimised, the in-step
    part catches a slot given up over a page landing in it within some 10^5 pages: hence more values.)"""
    run = run_sanitized(sanitized_build(sanitizer, "imm_selftest", tmp_path), str(values))
    assert f"imm selftest: {values} values through 64 slots, ok" in run.stdout
