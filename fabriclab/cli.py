"""Command-line plumbing shared by every stage: common options, the serve loop's stop signal, and errors
printed as one line (no traceback) with a non-zero exit status."""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
from typing import Any, Callable

from . import fi


def add_fabric_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", type=provider_name, default=None,
                        help="libfabric provider, or sim for fabriclab's modeled p5 NICs (docs/model.md) "
                             "(default: $FABRICLAB_PROVIDER, else the best available)")
    parser.add_argument("--domain", default=None,
                        help="domain / NIC name, e.g. lo under tcp;ofi_rxm (default: $FABRICLAB_DOMAIN or the first)")
    parser.add_argument("--fabric", type=fabric_name, default=None, metavar="NAME",
                        help="the provider's fabric, e.g. efa-direct where efa lists two (default: "
                             "$FABRICLAB_FABRIC, else the one named like the provider)")
    parser.add_argument("--timeout", type=positive_seconds, default=fi.DEFAULT_TIMEOUT,
                        help="seconds any single wait may take before it is an error (default %(default)s)")


def fabric_name(text: str) -> str:
    """argparse type for --fabric: it becomes $FABRICLAB_FABRIC, so every NIC set this process opens, and
    the peers it starts (bench's server), ask for the same fabric: both sides of a write must share it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--fabric needs a name such as efa or efa-direct")
    os.environ["FABRICLAB_FABRIC"] = text
    return text


def provider_name(text: str) -> str:
    """argparse type for --provider: asking for the modeled NICs (sim) points libfabric at them now, before
    anything starts libfabric without them."""
    if text == fi.MODELED_PROVIDER:
        try:
            fi.load_modeled_provider()
        except fi.UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def positive_size(text: str) -> int:
    """argparse type for byte counts: 4096, 64K, 1M, 16MiB."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be larger than zero")
    return value


def count(name: str, most: int | Callable[[], int] | None = None, why: str = "") -> Callable[[str], int]:
    """argparse type for a count (--threads, --nics, ...): a whole number from 1 to ``most`` (a callable is
    asked when the option is given: this machine's cores, say), refused with ``why`` said, whatever the stage
    (one that does not use the option still refuses it: a typo is noticed, not ignored)."""
    def parse(text: str) -> int:
        value: int | str
        try:
            value = int(text)
        except ValueError:
            value = text  # not a whole number: fi.integer says what it must be
        try:
            return fi.integer(value, name, 1, most() if callable(most) else most)
        except fi.UsageError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}{f' ({why})' if why else ''}") from None
    return parse


def positive_seconds(text: str) -> float:
    """argparse type for deadlines (--timeout): fi.seconds' rule, from the command line."""
    return _seconds(text, None)


def seconds_or_off(text: str) -> float:
    """argparse type for --link-timeout: the same, or 0 for off."""
    return _seconds(text, "failover off")


def _seconds(text: str, zero_means: str | None) -> float:
    value: float | str
    try:
        value = float(text)
    except ValueError:
        value = text  # not a number: fi.seconds says what it must be
    try:
        return fi.seconds(value, "seconds", zero_means=zero_means)
    except fi.UsageError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    number = t[:-1] if scale > 1 else t
    try:
        return int(float(number) * scale)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64K, 1M, 2G)") from None


def table(header: tuple[str, ...], rows: list[tuple[str, ...]], left: int) -> str:
    """A text table: columns padded to their widest cell, the first ``left`` to the left, the rest to the
    right, a rule under the header."""
    cells = [header, *rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(v.rjust(w) if i >= left else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_size(n: int) -> str:
    """A byte count as sizes are written: 4 KiB, 64 KiB, 1 MiB, 2 GiB; in bytes unless a whole number of KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


_RATE = re.compile(r"((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([kmgt]?)(?:bit/s|bit|bps)?")
_RATE_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str | float) -> float:
    """Bits per second from a number (1e9) or text in either notation: 3.2G, 800M, 3.2Gbps, or tc's 100mbit,
    1gbit, 500kbit. Prefixes are decimal and "bps" is bits per second, as in link speeds (tc reads "bps"
    as bytes). 0 is accepted: callers say what no rate means."""
    if isinstance(rate, str):
        match = _RATE.fullmatch(rate.strip().lower())
        value = float(match[1]) * _RATE_PREFIXES[match[2]] if match else math.nan
    else:
        value = float(rate)
    if not (math.isfinite(value) and value >= 0):
        raise fi.UsageError(f"{rate!r} is not a rate in bits per second (examples: 3.2G, 800M, 1e9, 3.2Gbps, "
                            "100mbit, 1gbit, 500kbit)")
    return value


def bits_per_second(text: str) -> float:
    """argparse type for rates (--line-rate): parse_rate's notations."""
    try:
        return parse_rate(text)
    except fi.UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class StopSignal:
    """Set when the server should stop: SIGTERM, SIGINT, or (with --until-stdin-closes) stdin at EOF."""

    def __init__(self, watch_stdin: bool):
        self._event = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._event.set())
        if watch_stdin:
            threading.Thread(target=self._watch_stdin, daemon=True).start()

    def _watch_stdin(self) -> None:
        # os.read on the raw descriptor: a daemon thread blocked inside sys.stdin's buffered reader
        # would abort the interpreter at exit.
        try:
            while os.read(0, 4096):
                pass
        except (OSError, ValueError):
            pass
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()


def stage_parser(description: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``serve`` / ``connect ADDRESS`` command line every stage module has."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="open an endpoint, print its address as one hex line, serve until stopped")
    add_fabric_options(serve)
    serve.add_argument("--until-stdin-closes", action="store_true",
                       help="also stop when standard input closes (how the launcher stops servers)")
    connect = sub.add_parser("connect", help="connect to a server by the address it printed")
    add_fabric_options(connect)
    connect.add_argument("address", help="the hex line the server printed")
    return parser, serve, connect


def stage_main(parser: argparse.ArgumentParser, serve: Callable[[argparse.Namespace, StopSignal], int],
               connect: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """A stage's entry point: ``serve`` (stopped by signals or stdin closing) or ``connect``."""
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args, StopSignal(args.until_stdin_closes))
    return connect(args)


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a command's main; bad input and fabric errors end it with one line on stderr, never a traceback."""
    try:
        code = main(argv)
    except fi.UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except fi.FabriclabError as exc:  # fabric, transfer, testbed, a server that exited: one root
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # output piped into head and the like
        sys.stderr.close()
        sys.exit(0)
    sys.exit(code or 0)
