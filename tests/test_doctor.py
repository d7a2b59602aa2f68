"""`python -m fabriclab doctor`: every item with a verdict, on this box and on the recorded p5."""
import json
import os
import subprocess
import sys
import types

import pytest

from fabriclab.tools import doctor


def run_doctor(*args, launcher=()):
    return subprocess.run([*launcher, sys.executable, "-m", "fabriclab", "doctor", *args], capture_output=True,
                          text=True, timeout=120)


# doctor with a /dev/shm of its own (a tmpfs in a private mount namespace: root) that holds the owner record of
# an engine of another pid namespace, as a /dev/shm shared with a container run with --ipc=host does.
BESIDE_ANOTHER_PID_NAMESPACE = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=64m,mode=1777 fabriclab-test /dev/shm && "
                                "touch /dev/shm/fabriclab-engine.pidns1.pid7.uid0.start1 && exec \"$@\"", "sh"]


def test_this_box_is_reported_plainly():
    # doctor's /dev/shm item shows only where /dev/shm is shared with other pid namespaces: on the machine's
    # /dev/shm that depends on what else runs there (issue 31), so doctor gets one that always shows it.
    items = ["libfabric", "provider", "fabric", "NICs", "immediate data", "queue depths", "GPU memory",
             "GPU peers on this host", "same-host peers", "/dev/shm", "GPU <-> NIC groups", "cores to pin"]
    own_shm = os.geteuid() == 0
    done = run_doctor("--json", "--provider", "shm", launcher=BESIDE_ANOTHER_PID_NAMESPACE if own_shm else ())
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    checks = {c["item"]: c for c in report["checks"]}
    if own_shm:
        assert "records of fabriclab engines of 1 other pid namespace(s)" in checks["/dev/shm"]["found"]
    else:  # the machine's /dev/shm: what it shows is not this test's to judge
        items.remove("/dev/shm")
        checks.pop("/dev/shm", None)
    assert list(checks) == items
    assert all(c["verdict"] in (doctor.OK, doctor.SLOW, doctor.FAIL) for c in checks.values())
    assert checks["provider"]["verdict"] == doctor.SLOW and "EFA" in checks["provider"]["fix"]  # software provider
    assert "emulated" in checks["NICs"]["found"]  # shm has one domain
    assert checks["immediate data"]["verdict"] == doctor.OK
    assert report["verdict"].startswith("verdict: slow")


def test_the_text_report_names_each_fix():
    done = run_doctor("--provider", "tcp;ofi_rxm")
    assert done.returncode == 0, done.stderr
    assert "fix: a software provider" in done.stdout and "lo" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("verdict: ")


def test_the_recorded_p5_groups_four_close_nics_per_gpu():
    done = run_doctor("--recorded", "p5.48xlarge", "--json")
    assert done.returncode == 0, done.stderr
    checks = {c["item"]: c for c in json.loads(done.stdout)["checks"]}
    assert "32 efa NIC(s) of 100 Gbps = 3200 Gbps" in checks["NICs"]["found"]
    groups = checks["GPU <-> NIC groups"]
    assert groups["verdict"] == doctor.OK and groups["found"].count("-> 4 NIC(s) (PIX)") == 8
    assert checks["cores to pin"]["found"].count("cuda:") == 8


@pytest.mark.parametrize("args, message", [(["--provider", "nosuch"], "unknown or unusable provider 'nosuch'"),
                                           (["--recorded", "nosuch"], "nosuch")])
def test_bad_input_is_one_line(args, message):
    done = run_doctor(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_efa_same_host_peers_take_shared_memory_unless_turned_off(monkeypatch):
    switch = "FI_EFA_ENABLE_SHM_TRANSFER"
    monkeypatch.delenv(switch, raising=False)
    check = doctor.check_same_host_path("efa")
    assert check.verdict == doctor.SLOW and f"{switch}=0" in check.fix
    monkeypatch.setenv(switch, "0")
    assert doctor.check_same_host_path("efa").verdict == doctor.OK


def test_too_small_immediate_data_or_queues_are_called_out():
    # what fi_getinfo reports, as plain numbers (an efa-direct entry of some releases: cq_data_size 0)
    entry = types.SimpleNamespace(cq_data_size=0, tx_size=16, rx_size=16)
    assert doctor.check_immediate_data(entry).verdict == doctor.FAIL
    assert doctor.check_queue_depths(entry).verdict == doctor.SLOW
    assert doctor.verdict_line([doctor.check_immediate_data(entry)]).startswith("verdict: will fail")


def test_efa_direct_is_called_out_and_short_immediate_data_fails():
    def entry(fabric, domain="rdmap79s0-rdm"):
        return types.SimpleNamespace(fabric=fabric, provider="efa", domain=domain)
    listed = [entry("efa-direct"), entry("efa")]
    assert doctor.check_fabric(listed, [entry("efa")]).verdict == doctor.OK
    check = doctor.check_fabric(listed, [entry("efa-direct")])
    assert check.verdict == doctor.SLOW and "also offered: efa" in check.found and "--fabric efa" in check.fix
    assert doctor.check_fabric(listed, []).verdict == doctor.FAIL  # no fabric offers 4-byte immediate data
