"""AddressSanitizer and ThreadSanitizer builds of the native engine, run on a short transfer
(native/selftest: a target and a 2-thread batched, lazy, FI_MORE writer over shm in one process, counting
every write, then as the article's receiver)."""
import subprocess

import pytest

from native_build import (ROOT, SANITIZER_ENV, compiler_with, libfabric_flags, sanitizer_flags,
                          sanitizer_reported)


def sanitized_build(sanitizer, selftest, tmp_path):
    """native/selftest/``selftest``.c built with the engine under ``sanitizer`` (None: optimised, as the module
    is built), skipping where that cannot be."""
    cc = compiler_with(sanitizer, tmp_path)
    binary = tmp_path / f"{selftest}-{sanitizer}"
    engine = [str(p) for p in sorted((ROOT / "native").glob("*.c"))]  # the engine's files (core_internal.h)
    build = subprocess.run([cc, *sanitizer_flags(sanitizer), str(ROOT / "native" / "selftest" / f"{selftest}.c"),
                            *engine, *libfabric_flags(), "-lfabric", "-lpthread", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary


def run_sanitized(binary, *args):
    run = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", **SANITIZER_ENV})
    assert run.returncode == 0, run.stdout + run.stderr
    assert not sanitizer_reported(run.stderr)
    return run


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_engine_under_sanitizer(sanitizer, tmp_path):
    run = run_sanitized(sanitized_build(sanitizer, "engine_selftest", tmp_path))
    assert "engine selftest: 257 writes, ok" in run.stdout
    assert "engine selftest, last writes marked: 257 writes, 4 marks, ok" in run.stdout


@pytest.mark.parametrize("sanitizer, values", [("address", 20000), ("thread", 20000), (None, 300000)])
def test_immediate_counts_under_sanitizer(sanitizer, values, tmp_path):
    """Issue 21, item 3: two threads count the pages of ``values`` arrivals as they land while a third awaits,
    takes and gives back each, through a table of 64 slots; one value's pages land in step with an expect()
    after another that takes each and gives its slot back at once: every page counted once, every slot back, a
    table every slot of which is awaited refusing and reporting what it could not count; values nobody awaits
    giving their slots up (the oldest first, or expired; issue 31, item 6), a flood of them landing on a thread
    of its own while expects count exactly; no data race, no leak. (Optimised, the in-step
    part catches a slot given up over a page landing in it within some 10^5 pages: hence more values.)"""
    run = run_sanitized(sanitized_build(sanitizer, "imm_selftest", tmp_path), str(values))
    assert f"imm selftest: {values} values through 64 slots, ok" in run.stdout
