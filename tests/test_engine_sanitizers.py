"""AddressSanitizer and ThreadSanitizer builds of the native engine, run on a short transfer
(native/selftest: a target and a 2-thread batched, lazy, FI_MORE writer over shm in one process)."""
import subprocess

import pytest

from native_build import (ROOT, SANITIZER_ENV, compiler_with, libfabric_flags, sanitizer_flags,
                          sanitizer_reported)


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_engine_under_sanitizer(sanitizer, tmp_path):
    cc = compiler_with(sanitizer, tmp_path)
    binary = tmp_path / f"selftest-{sanitizer}"
    engine = [str(ROOT / "native" / name) for name in ("core.c", "course.c", "service.c", "resting.c")]
    build = subprocess.run([cc, *sanitizer_flags(sanitizer), str(ROOT / "native" / "selftest" / "engine_selftest.c"),
                            *engine, *libfabric_flags(), "-lfabric", "-lpthread", "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", **SANITIZER_ENV})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine selftest: 257 writes, ok" in run.stdout
    assert not sanitizer_reported(run.stderr)
