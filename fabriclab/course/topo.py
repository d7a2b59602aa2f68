"""``python -m fabriclab topo``: this machine's GPU <-> NIC <-> NUMA <-> CPU layout (``fabriclab.topology``),
or a recorded one, as a table or as JSON, and its PCIe tree drawn to a file (``figures.pcie_tree``, chapter
8's figure; matplotlib is needed only for ``--draw``)."""
from __future__ import annotations

import argparse
import os
import pathlib

from ..fi import UsageError
from ..topology import THIS_MACHINE, Topology, format_table, recorded_names


def add_arguments(parser) -> None:
    parser.add_argument("--recorded", metavar="NAME", default=None,
                        help=f"show a recorded layout instead of this machine ({', '.join(recorded_names()) or 'none'})")
    parser.add_argument("--json", action="store_true", help="print the layout as one JSON object (loadable again)")
    parser.add_argument("--draw", metavar="FILE", default=None, type=drawing_file,
                        help="save a drawing of the PCIe tree (.png, .svg, .pdf)")
    parser.add_argument("--provider", default=None,
                        help="libfabric provider whose domains are the NICs (default: the best available)")
    parser.add_argument("--name", default=THIS_MACHINE, help="what to call this machine (default: %(default)s)")


def drawing_file(text: str) -> str:
    """argparse type for --draw: a file in a directory that exists and can be written, with a suffix naming a
    format matplotlib writes; refused before the machine is looked at."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory: name a file in it, such as {path / 'pcie.svg'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {path.parent} does not exist: create it first")
    if not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {path.parent} is not writable")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("drawing needs matplotlib: pip install 'fabriclab[lab]'") from None
    others = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"png", "svg", "pdf"})
    if path.suffix[1:].lower() not in {"png", "svg", "pdf", *others}:
        raise argparse.ArgumentTypeError(f"{text!r}: {path.suffix!r} is not a format matplotlib writes: name a .png, "
                                         f".svg or .pdf file (or .{', .'.join(others)})")
    return text


def main(args) -> int:
    if args.recorded:
        try:
            topo = Topology.load(args.recorded)
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None  # the command line prints these as one line
    else:
        topo = Topology.discover(provider=args.provider, machine=args.name)
    if args.json:
        print(topo.to_json())
    else:
        print(format_table(topo))
    if args.draw:
        try:
            from .figures import pcie_tree  # matplotlib: only for a drawing
            pcie_tree(topo).savefig(args.draw, dpi=150)
        except OSError as exc:  # checked when parsed; the disk or the directory may still say no
            raise UsageError(f"cannot save the drawing to {args.draw}: {exc.strerror or exc}") from None
        if not args.json:
            print(f"drawing saved to {args.draw}")
    return 0
