"""The testbed's plumbing: its errors, and the ``ip``/``tc``/``iptables`` commands it runs inside a network
namespace and what it reads back from them (``fabriclab.tools.testbed`` is the front)."""
from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess

from .. import fi

LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
LOSS_CHAIN = "FABRICLAB-LOSS"
COMMAND_TIMEOUT = 30.0
SIDES = ("server", "client")


class TestbedError(fi.FabriclabError, RuntimeError):
    """Setting up, using or tearing down the testbed failed; the message names what and how to fix it."""
    __test__ = False


class TestbedUnavailable(TestbedError):
    """This machine (or this user) cannot make namespaces: no root, no iproute2, no netns support."""


class ContainmentError(TestbedError):
    """Something in the testbed could reach, or be, an address outside its own namespaces."""


def side(side: str) -> str:
    aliases = {"server": "server", "a": "server", "client": "client", "b": "client"}
    if side not in aliases:
        raise fi.UsageError(f"side must be 'server' or 'client', got {side!r}")
    return aliases[side]


def run(cmd: list[str], *, input: str | None = None, check: bool = True,
        timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedUnavailable(f"{cmd[0]} not found on PATH (install iproute2"
                                 f"{' and iptables' if cmd[0].startswith('iptables') else ''})") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(cmd)}` did not finish within {timeout:g} s") from None
    if check and done.returncode != 0:
        text = (done.stderr or done.stdout).strip().replace("\n", "; ")
        raise TestbedError(f"`{' '.join(cmd)}` failed: {text or f'exit status {done.returncode}'}")
    return done


def ip_json(ns: str, *args: str, check: bool = True) -> list[dict]:
    done = run(["ip", "-j", "-n", ns, *args], check=check)
    text = done.stdout.strip() if done.returncode == 0 else ""
    return json.loads(text) if text else []


def veth_names(ns: str) -> list[str]:
    return [d["ifname"] for d in ip_json(ns, "link", "show", "type", "veth")]


def link_state(info: dict) -> str:
    flags = info.get("flags", [])
    if "UP" not in flags:
        return "down"
    if "NO-CARRIER" in flags or "LOWER_UP" not in flags:
        return "no-carrier"
    return "up"


def qdiscs(ns: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    done = run(["tc", "-j", "-n", ns, "qdisc", "show"], check=False)
    for q in json.loads(done.stdout or "[]") if done.returncode == 0 else []:
        dev = out.setdefault(q.get("dev"), {})
        opts = q.get("options", {})
        if q.get("kind") == "tbf" and "rate" in opts:
            dev["rate_bps"] = int(opts["rate"]) * 8  # tc -j reports bytes per second
        if q.get("kind") == "netem":
            delay = opts.get("delay", {})
            dev["delay"] = delay.get("delay") if isinstance(delay, dict) else delay
    return out


def has_loss_chain(ns: str) -> bool:
    if shutil.which("iptables") is None:
        return False
    return run(["ip", "netns", "exec", ns, "iptables", "-w", "-S", LOSS_CHAIN], check=False).returncode == 0


def loss_rules(ns: str) -> dict[str, float]:
    if shutil.which("iptables") is None:
        return {}
    done = run(["ip", "netns", "exec", ns, "iptables", "-w", "-S", LOSS_CHAIN], check=False)
    out = {}
    for line in done.stdout.splitlines():
        m = re.search(r"-i (\S+) .*--probability ([0-9.eE+-]+)", line)
        if m:
            out[m.group(1)] = round(float(m.group(2)), 6)
    return out
