"""``python -m fabriclab COMMAND``: info about this machine's fabric, and the course's tools."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from . import cli, fi, gpu, shmclean


def provider_report(provider: str) -> dict:
    entries = fi.getinfo(provider)
    hmem = fi.getinfo(provider, hmem=None)[0].hmem
    seen, domains = set(), []
    for info in entries:
        if info.domain in seen:
            continue
        seen.add(info.domain)
        nic = info.nic
        domains.append({
            "domain": info.domain, "fabric": info.fabric, "addr_format": info.addr_format_name,
            "mr_mode": info.mr_mode_names, "mode": info.mode_names, "max_msg_size": info.max_msg_size,
            "inject_size": info.inject_size, "cq_data_size": info.cq_data_size, "tx_size": info.tx_size,
            "nic": None if nic is None else {"name": nic.name, "pci": nic.pci, "link_speed_bps": nic.link_speed_bps,
                                             "state": nic.link_state, "mtu": nic.mtu},
        })
    return {"provider": provider, "hmem": hmem, "domains": domains}


def info_report() -> dict:
    fi.load_modeled_provider()  # listed (never the default) so that a reader sees --provider sim exists
    providers = fi.available_providers()
    try:
        default = fi.default_provider()
    except fi.FabricError:
        default = None
    return {
        "libfabric": fi.library_version(),
        "default_provider": default,
        "providers": [provider_report(p) for p in providers],
        "cuda": gpu.cuda_status(),
        "gpus": [vars(d) for d in gpu.devices()],
    }


def print_info(report: dict) -> None:
    print(f"libfabric {report['libfabric']}; default provider: {report['default_provider']}")
    for p in report["providers"]:
        mark = "*" if p["provider"] == report["default_provider"] else " "
        print(f"{mark} {p['provider']}  (FI_HMEM {'offered' if p['hmem'] else 'not offered'})")
        for d in p["domains"]:
            nic = d["nic"]
            extra = ""
            if nic:
                extra = "".join([f", pci {nic['pci']}" if nic["pci"] else "",
                                 f", link {nic['link_speed_bps'] / 1e9:g} Gbps" if nic["link_speed_bps"] else ""])
            print(f"    domain {d['domain']:<14} fabric {d['fabric']:<16} {d['addr_format']:<16} "
                  f"mr_mode [{' '.join(d['mr_mode']) or '-'}] inject {d['inject_size']} "
                  f"cq_data {d['cq_data_size']}B{extra}")
    if report["gpus"]:
        for g in report["gpus"]:
            print(f"GPU {g['index']}: {g['name']} at {g['pci']}, {g['memory_bytes'] / 2**30:.0f} GiB")
    else:
        print(f"GPUs: none ({report['cuda']})")


def main_info(args) -> int:
    # Looking at the machine is the moment to tidy what killed processes left in /dev/shm.
    reclaimed = shmclean.reclaim_stale_shm_regions()
    report = info_report()
    if args.json:
        report["reclaimed_shm_regions"] = [vars(r) for r in reclaimed]
        print(json.dumps(report))
    else:
        print_info(report)
        if reclaimed:
            print(shmclean.describe(reclaimed))
    return 0


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object")


#: command -> (help, module (imported only when used), its entry point, its argument setup)
COMMANDS = {
    "info": ("providers, domains/NICs, FI_HMEM support and CUDA devices on this machine",
             "fabriclab.__main__", "main_info", "add_info_arguments"),
    "bench": ("the one benchmark harness: Gbps, Mops/s, ns of CPU per write, memcpy ceiling",
              "fabriclab.tools.bench", "main", "add_arguments"),
    "fanin": ("many writer processes into one target engine: pages/s in all and per writer, exact counts, "
              "byte-exact", "fabriclab.tools.fanin", "main", "add_arguments"),
    "tour": ("run every lesson headless and print the measured figures beside the article's",
             "fabriclab.course.tour", "main", "add_arguments"),
    "testbed": ("two network namespaces joined by N shaped veth links, a small p5: up, down, status, link-down, "
                "link-up", "fabriclab.tools.testbed", "cli_main", "add_arguments"),
    "doctor": ("check this machine for the course and the library (a p5 first of all): provider, fabric, NICs, "
               "immediate data, GPU memory path, same-host path, GPU <-> NIC groups, cores; a verdict and a fix "
               "per item", "fabriclab.tools.doctor", "main", "add_arguments"),
    "clean": ("remove the shared-memory regions (/dev/shm) that killed processes left behind, where every owner "
              "is visible (others are listed as left; --force takes them too); --dry-run lists them",
              "fabriclab.shmclean", "main", "add_arguments"),
    "topo": ("GPU <-> NIC <-> NUMA <-> CPU layout and the proposed NIC groups and cores (or a recorded one: "
             "--recorded p5.48xlarge)", "fabriclab.course.topo", "main", "add_arguments"),
    "apidoc": ("the API reference of fabriclab.Engine and fabriclab.bootstrap, rendered from the docstrings into "
               "Markdown; fails on a docstring reference that does not resolve", "fabriclab.tools.apidoc", "main",
               "add_arguments"),
}


def _entry(command: str, which: int):
    _, module, *names = COMMANDS[command]
    return getattr(importlib.import_module(module), names[which])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fabriclab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, *_) in COMMANDS.items():
        _entry(name, 1)(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return _entry(args.command, 0)(args)


def entry() -> None:
    cli.run(main, sys.argv[1:])


if __name__ == "__main__":
    entry()
