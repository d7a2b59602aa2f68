"""Figures for the lessons. Every function returns a matplotlib Figure (not registered with pyplot, so a
notebook shows it once when it is a cell's value, and a script can ``fig.savefig(...)`` it).

Diagrams (``network_stacks``, ``post_and_poll``, ``message_sequence``) are drawn from fixed text; the
others draw what they are given: ``object_tree`` the live tree of ``fi.describe_tree``, ``timeline`` a
``lesson.Trace``, ``roadmap`` the article's milestones from ``tour.ARTICLE``, ``pcie_tree`` a
``topology.Topology``.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .. import measure
from ..cli import format_size
from ..topology import Topology, format_cpulist

# One palette for every lesson.
COLORS = {
    "app": "#dbe9f6", "user": "#c6e2c3", "kernel": "#f6d7b0", "nic": "#d9c8ea", "data": "#c0392b",
    "control": "#7f8c8d", "recv": "#2e86c1", "send": "#d35400", "write": "#8e44ad", "grid": "#e5e5e5",
}
DPI = 90


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=DPI)


def _canvas(fig: Figure, rect=(0, 0, 1, 1), xlim=(0, 10), ylim=(0, 10)):
    """An axes with no ticks in data units, for diagrams."""
    ax = fig.add_axes(rect)
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    return ax


def _box(ax, x, y, w, h, text, color, fontsize=9, weight="normal", style="round,pad=0.02,rounding_size=0.12",
         edge="#555555", text_color="black", ha="center"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=color, edgecolor=edge, linewidth=1))
    tx = x + w / 2 if ha == "center" else x + 0.15
    ax.text(tx, y + h / 2, text, ha=ha, va="center", fontsize=fontsize, weight=weight, color=text_color)


def _arrow(ax, start, end, color="black", width=1.2, style="-|>", dashed=False, text=None, text_xy=None,
           fontsize=8, text_color=None, ha="center", connection="arc3"):
    ax.annotate("", xy=end, xytext=start,
                arrowprops=dict(arrowstyle=style, color=color, lw=width, linestyle="--" if dashed else "-",
                                shrinkA=0, shrinkB=0, connectionstyle=connection))
    if text:
        x, y = text_xy or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(x, y, text, fontsize=fontsize, color=text_color or color, ha=ha, va="center")


# ---------------------------------------------------------------------------------------- chapter 0


_GBPS = re.compile(r"([\d.]+)\s*Gbps")


def milestones(article: Mapping[int, tuple[str, str]]) -> list[tuple[int, str, float, bool]]:
    """(chapter, stage, Gbps, one_nic) for every milestone of ``article`` (tour.ARTICLE) that has a rate."""
    out = []
    for chapter, (stage, text) in sorted(article.items()):
        m = _GBPS.search(text)
        if m:
            out.append((chapter, stage, float(m.group(1)), "one NIC" in text))
    return out


def roadmap(article: Mapping[int, tuple[str, str]] | None = None, nic_gbps: float = 100.0,
            total_gbps: float = 3200.0) -> Figure:
    """The article's milestones: single-NIC figures against one link, then the 32-NIC climb to 3200 Gbps."""
    if article is None:
        from .tour import ARTICLE as article
    rows = milestones(article)
    one = [r for r in rows if r[3]]
    many = [r for r in rows if not r[3]]
    fig = _figure(10, 3.4)
    ax1 = fig.add_axes((0.06, 0.2, 0.18, 0.65))
    ax2 = fig.add_axes((0.32, 0.2, 0.66, 0.65))
    for ax, group, ceiling, title in ((ax1, one, nic_gbps, f"one NIC ({nic_gbps:g} Gbps link)"),
                                      (ax2, many, total_gbps, f"all NICs ({total_gbps:g} Gbps)")):
        xs = range(len(group))
        bars = ax.bar(xs, [g for _, _, g, _ in group], color=COLORS["recv"] if ax is ax1 else COLORS["send"],
                      width=0.6, zorder=2)
        ax.axhline(ceiling, color="black", lw=1, ls="--", zorder=1)
        ax.set_ylim(0, ceiling * 1.15)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"ch{c}\n{s}" for c, s, _, _ in group], fontsize=7)
        ax.set_ylabel("Gbps", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", color=COLORS["grid"], zorder=0)
        for bar, (_, _, gbps, _) in zip(bars, group):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + ceiling * 0.02,
                    f"{gbps:g}\n{gbps / ceiling:.0%}", ha="center", va="bottom", fontsize=6.5)
    fig.suptitle("Milestones of the article on AWS p5 (what this course rebuilds, chapter by chapter)",
                 fontsize=10, y=0.99)
    return fig


# ---------------------------------------------------------------------------------------- chapter 1


def network_stacks() -> Figure:
    """Sockets over the kernel's TCP/IP stack beside RDMA through libfabric: where each byte goes."""
    fig = _figure(10, 5.8)
    ax = _canvas(fig, xlim=(0, 20), ylim=(-0.9, 11))

    def boundary(x0, x1, y, above, below):
        ax.plot([x0, x1], [y, y], color="#999999", lw=1, ls=":")
        ax.text(x1 + 0.1, y + 0.12, above, fontsize=7, color="#555555", style="italic", va="bottom")
        ax.text(x1 + 0.1, y - 0.12, below, fontsize=7, color="#555555", style="italic", va="top")

    # Left: sockets.
    x, w = 0.4, 7.6
    ax.text(x + w / 2, 10.7, "Sockets (kernel TCP/IP)", ha="center", fontsize=11, weight="bold")
    _box(ax, x, 9.2, w, 1.0, "application", COLORS["app"])
    _box(ax, x, 7.8, w, 0.9, "socket calls: send() / recv(), a system call each", COLORS["user"])
    boundary(x - 0.2, x + w + 0.2, 7.3, "user", "kernel")
    _box(ax, x, 5.9, w, 0.85, "socket buffers (bytes copied in and out)", COLORS["kernel"])
    _box(ax, x, 4.85, w, 0.85, "TCP: ordering, retransmission, congestion control", COLORS["kernel"])
    _box(ax, x, 3.8, w, 0.85, "IP: routing, checksums", COLORS["kernel"])
    _box(ax, x, 2.75, w, 0.85, "NIC driver, interrupts", COLORS["kernel"])
    boundary(x - 0.2, x + w + 0.2, 2.0, "", "hardware")
    _box(ax, x, 0.5, w, 1.0, "Ethernet NIC", COLORS["nic"])
    _arrow(ax, (x + 0.35, 9.2), (x + 0.35, 1.5), color=COLORS["data"], width=2.5)
    ax.text(x + w / 2, -0.35, "data path: every message crosses into the kernel,\nis copied, and costs CPU "
            "time for the protocol", color=COLORS["data"], fontsize=7.5, ha="center", va="center")

    # Right: RDMA through libfabric.
    x, w = 10.9, 7.6
    ax.text(x + w / 2, 10.7, "RDMA through libfabric", ha="center", fontsize=11, weight="bold")
    _box(ax, x, 9.2, w, 1.0, "application  +  its registered buffers", COLORS["app"])
    _box(ax, x, 7.8, w, 0.9, "libfabric: fi_send / fi_recv / fi_write / fi_cq_read", COLORS["user"])
    _box(ax, x + 1.0, 6.55, w - 1.0, 0.85, "provider: efa, verbs, shm, tcp ...", COLORS["user"])
    _box(ax, x + 1.0, 5.3, w - 1.0, 0.85, "user-space driver: hands work to the NIC", COLORS["user"])
    boundary(x - 0.2, x + w + 0.2, 4.6, "user", "kernel")
    _box(ax, x + 2.6, 2.6, w - 2.6, 1.45, "kernel driver, set-up only:\nopen the device, register\nmemory, "
         "create queues", COLORS["kernel"], fontsize=8)
    boundary(x - 0.2, x + w + 0.2, 2.0, "", "hardware")
    _box(ax, x, 0.5, w, 1.0, "RDMA NIC (EFA: the SRD transport runs on the card)", COLORS["nic"])
    _arrow(ax, (x + 0.35, 9.2), (x + 0.35, 1.5), color=COLORS["data"], width=2.5)
    ax.text(x + 0.6, 3.4, "no kernel,\nno copy:\nthe NIC DMAs\nyour buffers", color=COLORS["data"],
            fontsize=7.5, va="center")
    _arrow(ax, (x + w - 0.8, 5.3), (x + w - 0.8, 4.05), color=COLORS["control"], dashed=True)
    ax.text(x + w / 2, -0.35, "data path: the application posts work, the NIC moves the bytes,\nthe kernel "
            "only helped set things up", color=COLORS["data"], fontsize=7.5, ha="center", va="center")
    return fig


# ---------------------------------------------------------------------------------------- chapter 2


def post_and_poll() -> Figure:
    """The asynchronous model: post work requests that describe registered memory, the NIC works on them,
    completions come back through a queue the application polls."""
    fig = _figure(10, 4.8)
    ax = _canvas(fig, xlim=(0, 20), ylim=(0, 9.6))
    _box(ax, 0.3, 6.2, 5.0, 2.2, "application thread\n(posts work, polls for\ncompletions, never blocks)",
         COLORS["app"], fontsize=8.5)
    _box(ax, 7.4, 0.3, 6.0, 1.3, "registered memory: allocated and registered\nonce, reused by every operation",
         COLORS["user"], fontsize=8)
    _box(ax, 15.4, 2.4, 4.2, 5.6, "NIC\n\n(for shm and tcp,\nthe provider's\nsoftware plays\nits part)",
         COLORS["nic"], fontsize=8.5)

    def queue(y, title, filled, color):
        ax.text(10.4, y + 1.0, title, ha="center", fontsize=8)
        for i in range(8):
            face = color if i < filled else "white"
            ax.add_patch(FancyBboxPatch((7.6 + i * 0.7, y), 0.6, 0.75, boxstyle="square,pad=0", facecolor=face,
                                        edgecolor="#555555", lw=0.8))

    queue(7.4, "send queue (at most tx_size posted)", 5, COLORS["send"])
    queue(5.2, "receive queue (receives posted ahead of time)", 8, COLORS["recv"])
    queue(3.0, "completion queue", 3, "#7dcea0")
    _arrow(ax, (5.3, 7.9), (7.5, 7.8))
    ax.text(6.4, 8.35, "post send / write\n(returns at once)", fontsize=7, ha="center", va="bottom")
    _arrow(ax, (5.3, 6.7), (7.5, 5.6))
    ax.text(6.55, 5.75, "post receive\nbefore data\narrives", fontsize=7, ha="right", va="top")
    _arrow(ax, (13.3, 7.8), (15.4, 7.0))
    _arrow(ax, (13.3, 5.6), (15.4, 5.2))
    _arrow(ax, (15.4, 3.2), (13.3, 3.4))
    ax.text(15.2, 2.75, "one entry per\nfinished operation,\nin any order", fontsize=7, ha="right", va="top")
    _arrow(ax, (7.5, 3.35), (2.8, 6.2), connection="arc3,rad=-0.2")
    ax.text(0.3, 4.3, "poll (fi_cq_read): each entry\ncarries the context that was\nposted with the operation",
            fontsize=7, ha="left", va="center")
    _arrow(ax, (16.2, 2.4), (13.4, 1.0), color=COLORS["data"], width=2, style="<|-|>")
    ax.text(16.0, 1.2, "the NIC reads and writes\nthese buffers itself (DMA)", color=COLORS["data"], fontsize=7,
            ha="left", va="center")
    ax.text(15.4, 9.0, "queue full? the post returns -FI_EAGAIN:\nkeep the work in your own list, poll, retry",
            fontsize=7, color="#a93226", ha="left", va="center")
    return fig


# ---------------------------------------------------------------------------------------- chapter 3

#: The libfabric calls that create each kind of object in fabriclab.fi.
CREATED_BY = {
    "Fabric": "fi_fabric", "Domain": "fi_domain", "CompletionQueue": "fi_cq_open", "AddressVector": "fi_av_open",
    "Endpoint": "fi_endpoint, fi_ep_bind, fi_enable", "MemoryRegion": "fi_mr_regattr",
}


def _tree_nodes(tree: Sequence[tuple[int, str]]) -> list[dict]:
    """Nodes with parent/children indices from describe_tree's (depth, label) pairs (pre-order)."""
    nodes, stack = [], []
    for depth, text in tree:
        node = {"label": text, "depth": depth, "children": [], "parent": None}
        while stack and nodes[stack[-1]]["depth"] >= depth:
            stack.pop()
        if stack:
            node["parent"] = stack[-1]
            nodes[stack[-1]]["children"].append(len(nodes))
        nodes.append(node)
        stack.append(len(nodes) - 1)
    return nodes


def object_tree(tree: Sequence[tuple[int, str]], title: str | None = None) -> Figure:
    """Draw a live resource tree (``fi.describe_tree(stack.fabric)``): each object with the call that
    made it; dashed lines show what the endpoint is bound to."""
    nodes = _tree_nodes(tree)
    if not nodes:
        raise ValueError("empty tree")
    leaf = [0]

    def place(i):
        kids = nodes[i]["children"]
        if not kids:
            nodes[i]["x"] = leaf[0]
            leaf[0] += 1
        else:
            for k in kids:
                place(k)
            nodes[i]["x"] = sum(nodes[k]["x"] for k in kids) / len(kids)

    for i, n in enumerate(nodes):
        if n["parent"] is None:
            place(i)
    width = max(leaf[0], 1)
    depth = max(n["depth"] for n in nodes) + 1
    fig = _figure(max(6.0, 2.2 * width), 1.2 * depth + 0.9)
    ax = _canvas(fig, xlim=(-0.6, width - 0.4), ylim=(-depth - 0.25, 0.45))
    bw, bh = 0.92, 0.62
    for n in nodes:
        n["y"] = -n["depth"]
    for n in nodes:
        if n["parent"] is not None:
            p = nodes[n["parent"]]
            ax.plot([p["x"], p["x"], n["x"], n["x"]], [p["y"] - bh / 2, p["y"] - 0.5, p["y"] - 0.5, n["y"] + bh / 2],
                    color="#555555", lw=1, zorder=1)
    colors = {"Fabric": COLORS["nic"], "Domain": COLORS["kernel"], "Endpoint": COLORS["app"]}
    for n in nodes:
        kind, _, rest = n["label"].partition(" ")
        text = kind + (f"\n{rest}" if rest else "")
        call = CREATED_BY.get(kind)
        _box(ax, n["x"] - bw / 2, n["y"] - bh / 2, bw, bh, "", colors.get(kind, COLORS["user"]))
        ax.text(n["x"], n["y"] + bh / 2 - 0.08, text, ha="center", va="top", fontsize=8)
        if call:
            ax.text(n["x"], n["y"] - bh / 2 + 0.06, call.replace(", ", "\n") if len(call) > 20 else call,
                    ha="center", va="bottom", fontsize=6, color="#1f4e79", family="monospace")
    # fi_ep_bind: the endpoint uses its sibling completion queue and address vector (arcs below the row).
    for n in nodes:
        if n["label"].startswith("Endpoint") and n["parent"] is not None:
            for k in nodes[n["parent"]]["children"]:
                other = nodes[k]
                if other["label"].startswith(("CompletionQueue", "AddressVector")):
                    y = n["y"] - bh / 2 - 0.04
                    rad = -0.25 if other["x"] < n["x"] else 0.25
                    ax.annotate("", xy=(other["x"], y), xytext=(n["x"], y),
                                arrowprops=dict(arrowstyle="-|>", color=COLORS["recv"], lw=1, ls="--",
                                                connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0))
            if any(nodes[k]["label"].startswith(("CompletionQueue", "AddressVector"))
                   for k in nodes[n["parent"]]["children"]):
                ax.text(n["x"] - 0.5, n["y"] - bh / 2 - 0.62, "bound to (fi_ep_bind)", fontsize=7,
                        color=COLORS["recv"], ha="right", va="center")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def bandwidth(sizes: Sequence[int], rates: Sequence[float], label: str = "measured here",
              reference_gbps: float | None = None, reference_label: str = "") -> Figure:
    """Gbps against message size (``rates`` in bytes per second), optionally with a reference line."""
    fig = _figure(7, 3.2)
    ax = fig.add_axes((0.1, 0.17, 0.86, 0.72))
    gbps = [measure.gbps(r, 1.0) for r in rates]  # bytes in one second
    ax.plot(sizes, gbps, marker="o", color=COLORS["send"], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([format_size(s) for s in sizes], fontsize=8)
    ax.set_xlabel("message size", fontsize=8)
    ax.set_ylabel("Gbps", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    if reference_gbps:
        ax.axhline(reference_gbps, color="black", ls="--", lw=1, label=reference_label or f"{reference_gbps:g} Gbps")
    ax.set_ylim(0, max(gbps + [reference_gbps or 0]) * 1.15)
    ax.grid(color=COLORS["grid"])
    ax.legend(fontsize=8, loc="lower right")
    return fig


# ---------------------------------------------------------------------------------------- chapter 4


def timeline(ops, title: str | None = None, unit: float = 1e-6, polls=None) -> Figure:
    """One lane per operation (a ``lesson.Trace`` or a list of ``lesson.Op``): a thick bar while the post
    call ran, a thin line while the operation was the provider's, a dot when its completion was read.
    A last lane shows the polls that returned completions (``polls``, taken from the trace by default)."""
    if polls is None:
        polls = getattr(ops, "polls", [])
    ops = ops.rows() if hasattr(ops, "rows") else sorted(ops, key=lambda op: op.posted)
    if not ops:
        raise ValueError("no operations to draw")
    t0 = min(op.posted for op in ops)
    lanes = len(ops) + (1 if polls else 0)
    height = 0.42 * lanes + 1.2
    fig = _figure(9, height)
    ax = fig.add_axes((0.25, 0.75 / height, 0.72, 1 - 1.15 / height))
    for i, op in enumerate(ops):
        y = lanes - 1 - i
        color = COLORS.get(op.kind, "#555555")
        start, back = (op.posted - t0) / unit, (op.returned - t0) / unit
        ax.plot([start, max(back, start)], [y, y], color=color, lw=7, solid_capstyle="butt")
        if op.completed is not None:
            done = (op.completed - t0) / unit
            ax.plot([back, done], [y, y], color=color, lw=1.2)
            ax.plot([done], [y], marker="o", color=color, ms=6)
    labels = [f"{op.side}: {op.kind} {format_size(op.length)}" for op in ops]
    if polls:
        ax.broken_barh([((a - t0) / unit, max((b - a) / unit, 0.0)) for a, b, _ in polls], (-0.3, 0.6),
                       facecolors=COLORS["control"])
        labels.append("polls that found completions")
    ax.set_yticks(range(lanes))
    ax.set_yticklabels(list(reversed(labels)), fontsize=8)
    ax.set_xlabel("microseconds since the first post" if unit == 1e-6 else f"time (units of {unit:g} s)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color=COLORS["grid"])
    ax.set_ylim(-0.7, lanes - 0.3)
    handles = [ax.plot([], [], color="#555555", lw=7)[0], ax.plot([], [], color="#555555", lw=1.2)[0],
               ax.plot([], [], color="#555555", marker="o", ls="")[0]]
    ax.legend(handles, ["post call", "in the provider's hands", "completion read"], fontsize=7, ncol=3,
              loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=10, pad=22)
    return fig


# ---------------------------------------------------------------------------------------- chapter 5


def message_sequence(in_flight: int = 3) -> Figure:
    """Chapter 5's conversation: the client introduces itself, then requests and replies flow both ways."""
    fig = _figure(9, 5.6)
    ax = _canvas(fig, xlim=(0, 20), ylim=(0.3, 12))
    cx, sx = 5.5, 14.5
    for x, name in ((cx, "client"), (sx, "server")):
        _box(ax, x - 1.6, 10.9, 3.2, 0.9, name, COLORS["app"], weight="bold")
        ax.plot([x, x], [0.6, 10.9], color="#555555", lw=1)

    def note(x, y, text, side):
        ax.text(x + (0.3 if side == "right" else -0.3), y, text, fontsize=7, color="#555555",
                ha="left" if side == "right" else "right", va="center")

    def message(y, left_to_right, text, color, dashed=False, label_at="middle"):
        a, b = (cx, sx) if left_to_right else (sx, cx)
        _arrow(ax, (a, y), (b, y - 0.5), color=color, dashed=dashed)
        if label_at == "middle":
            ax.text((cx + sx) / 2, y + 0.02, text, fontsize=8, ha="center", va="bottom", color=color)
        else:  # near the sender's end, where arrows drawn close together do not overlap it
            x = a + (0.4 if left_to_right else -0.4)
            ax.text(x, y + 0.02, text, fontsize=7.5, ha="left" if left_to_right else "right", va="bottom",
                    color=color)

    note(sx, 10.4, "prints its address\n(one hex line)", "right")
    message(10.1, False, "the address, carried out of band (launcher, ssh, copy and paste)", COLORS["control"],
            dashed=True)
    note(cx, 9.6, "fi_av_insert(server)", "left")
    message(9.0, True, "HELLO, carrying the client's own address", COLORS["send"])
    note(sx, 8.5, "fi_av_insert(client),\nnew client id", "right")
    message(7.9, False, "WELCOME, carrying the client id", COLORS["recv"])
    y = 6.9
    for i in range(in_flight):
        message(y, True, f"REQUEST {i + 1}", COLORS["send"], label_at="start")
        y -= 0.65
    note(sx, 5.9, f"{in_flight} requests outstanding:\nthe client's window\n(`in_flight` slots)", "right")
    y -= 0.2
    for i in range(in_flight):
        message(y, False, f"REPLY {i + 1} (the payload echoed)", COLORS["recv"], label_at="start")
        y -= 0.65
    note(cx, 3.4, "each receive slot is\nposted again once\nits message is read", "left")
    message(y - 0.3, True, "BYE", COLORS["send"])
    note(sx, y - 0.8, "fi_av_remove(client)", "right")
    return fig


def round_trips(samples: Mapping[str, Iterable[float]], unit: float = 1e-6, title: str | None = None) -> Figure:
    """Cumulative distribution of round-trip times (seconds), one line per label."""
    fig = _figure(7, 3.2)
    ax = fig.add_axes((0.1, 0.17, 0.86, 0.72))
    for i, (name, values) in enumerate(samples.items()):
        xs = sorted(v / unit for v in values)
        if not xs:
            continue
        ys = [(k + 1) / len(xs) for k in range(len(xs))]
        ax.step(xs, ys, where="post", label=name, color=[COLORS["recv"], COLORS["send"], COLORS["write"]][i % 3])
    ax.set_xscale("log")  # a few slow outliers (a descheduled process) would squash a linear axis
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("microseconds (log scale)" if unit == 1e-6 else f"units of {unit:g} s (log scale)", fontsize=8)
    ax.set_ylabel("fraction of requests", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_ylim(0, 1.02)
    ax.grid(color=COLORS["grid"])
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# ------------------------------------------------------------------------------- chapters 9-16 (progression)

#: The chapters of the multi-NIC progression in order; "13+" and "15+" are this project's extra steps
#: (padded counter shards, FI_MORE), which the article does not have.
PROGRESSION_ORDER = ("7", "9", "10", "11", "12", "13", "13+", "14", "15", "15+")
ARTICLE_CHAPTERS = ("9", "10", "11", "12", "13", "14", "15")


def _chapter_key(chapter) -> int:
    text = str(chapter)
    return PROGRESSION_ORDER.index(text) if text in PROGRESSION_ORDER else len(PROGRESSION_ORDER)


def progression_bars(measured: Mapping[str, float], article: Mapping[int, tuple[float, float]] | None = None,
                current: str | None = None, chapters: Sequence[str] | None = None,
                measured_label: str = "here: % of the memcpy ceiling",
                article_label: str = "article (p5): % of its line rate",
                title: str | None = None, recorded: Mapping[str, float] | None = None,
                recorded_label: str = "recorded") -> Figure:
    """The progression as two bars per chapter: the reader's measured percentage (``measured``, chapter
    name such as "9" or "13+" → percent) beside the article's (``article``: chapter → (Gbps, line-rate
    Gbps), by default ``tour.ARTICLE_GBPS``). Chapters shown: ``chapters``, else the article's 9-15 plus
    every measured one, so a lesson's bars fill in from left to right as the course goes on. ``current``
    (a chapter) is drawn in a stronger colour; extra steps the article lacks are labelled as such. ``recorded``
    (chapter → percent, course.recorded: a larger machine's run) adds a third bar between the two."""
    from matplotlib.patches import Patch
    if article is None:
        from .tour import ARTICLE_GBPS as article
    names = [str(c) for c in chapters] if chapters is not None else \
        sorted(set(ARTICLE_CHAPTERS) | {str(c) for c in measured}, key=_chapter_key)
    ref = {}
    for name in names:
        if name.isdigit() and int(name) in article:
            gbps, line = article[int(name)]
            ref[name] = 100.0 * gbps / line
    fig = _figure(max(6.0, 0.85 * len(names) + 2.2), 3.6)
    ax = fig.add_axes((0.09, 0.2, 0.89, 0.62))
    recorded = {str(k): float(v) for k, v in (recorded or {}).items()}
    width = 0.27 if recorded else 0.38
    paper_x, here_x = (-width, width) if recorded else (-width / 2, width / 2)
    here_color, past_color, paper_color, recorded_color = COLORS["send"], "#f0b27a", "#5d6d7e", "#a9cce3"
    top = max([100.0] + list(ref.values()) + [float(v) for v in measured.values()] + list(recorded.values()))
    for i, name in enumerate(names):
        if name in ref:
            ax.bar(i + paper_x, ref[name], width, color=paper_color)
            ax.text(i + paper_x, ref[name] + top * 0.01, f"{ref[name]:.1f}", ha="center", va="bottom",
                    fontsize=7, color=paper_color)
        else:
            ax.text(i + paper_x, top * 0.02, "not in\nthe article", ha="center", va="bottom", fontsize=6,
                    color="#999999", rotation=90)
        if name in recorded:
            ax.bar(i, recorded[name], width, color=recorded_color, hatch="//", edgecolor="#5d6d7e", linewidth=0.5)
            ax.text(i, recorded[name] + top * 0.01, f"{recorded[name]:.1f}", ha="center", va="bottom", fontsize=7,
                    color="#5d6d7e")
        if name in measured:
            value = float(measured[name])
            color = here_color if current is None or name == str(current) else past_color
            ax.bar(i + here_x, value, width, color=color, edgecolor="black" if name == str(current) else None,
                   linewidth=0.8)
            ax.text(i + here_x, value + top * 0.01, f"{value:.1f}", ha="center", va="bottom", fontsize=7,
                    color="black")
        else:
            ax.text(i + here_x, top * 0.02, "later", ha="center", va="bottom", fontsize=6, color="#999999",
                    rotation=90)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"ch {n}" for n in names], fontsize=8)
    for label, name in zip(ax.get_xticklabels(), names):
        if current is not None and name == str(current):
            label.set_fontweight("bold")
    ax.set_ylabel("percent", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.axhline(100, color="black", lw=0.8, ls="--")
    ax.grid(axis="y", color=COLORS["grid"])
    ax.set_axisbelow(True)
    handles, labels = [Patch(color=paper_color), Patch(color=here_color)], [article_label, measured_label]
    if recorded:
        handles.insert(1, Patch(facecolor=recorded_color, hatch="//", edgecolor="#5d6d7e"))
        labels.insert(1, recorded_label)
    ax.legend(handles, labels, fontsize=7.5, ncol=len(labels), loc="lower center", bbox_to_anchor=(0.5, 1.0),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10, pad=20)
    return fig


# ---------------------------------------------------------------------------------------- chapter 6


def one_sided_write(pages: int = 3) -> Figure:
    """Chapter 6's conversation: control messages over the mailbox, then one-sided writes that land in the
    target's registered memory, each carrying its page index as immediate data."""
    fig = _figure(13, 6.6)
    ax = _canvas(fig, xlim=(0, 26), ylim=(0, 13.2))
    wx, mx, tx = 3.4, 10.0, 15.4
    top, bottom = 11.8, 1.2
    _box(ax, wx - 2.0, top, 4.0, 1.0, "writer\n(posts every write)", COLORS["app"], fontsize=8.5, weight="bold")
    _box(ax, mx - 2.0, top, 4.0, 1.0, "target's registered\nmemory (pages)", COLORS["user"], fontsize=8.5,
         weight="bold")
    _box(ax, tx - 2.0, top, 4.0, 1.0, "target\n(CPU + completion queue)", COLORS["app"], fontsize=8.5, weight="bold")
    ax.plot([wx, wx], [bottom, top], color="#555555", lw=1)
    ax.plot([tx, tx], [bottom, top], color="#555555", lw=1)
    ax.plot([mx, mx], [10.4, top], color="#555555", lw=1, ls=":")
    ax.add_patch(FancyBboxPatch((mx - 0.35, bottom), 0.7, 10.4 - bottom, boxstyle="square,pad=0",
                                facecolor=COLORS["user"], edgecolor="#555555", lw=0.8))

    def control(y, to_target, text):
        a, b = (wx, tx) if to_target else (tx, wx)
        _arrow(ax, (a, y), (b, y - 0.35), color=COLORS["control"])
        if to_target:
            ax.text(wx + 0.3, y + 0.05, text, fontsize=7.5, ha="left", va="bottom", color="#333333")
        else:
            ax.text(tx - 0.3, y + 0.05, text, fontsize=7.5, ha="right", va="bottom", color="#333333")

    def note(x, y, text, ha="left", color="#555555"):
        ax.text(x, y, text, fontsize=7, color=color, ha=ha, va="center")

    control(11.3, True, "PREPARE: page size, bytes, memory kind")
    note(tx + 0.3, 10.75, "allocate the region,\nregister it (fi_mr_reg)")
    control(10.3, False, "REGION: base, length, key + CRC32")
    note(wx - 0.3, 9.75, "check the CRC,\nregister\nthe source", ha="right")
    note(tx + 0.3, 9.55, "mailbox messages (chapter 5):\nsend and receive", color=COLORS["control"])
    y = 9.0
    for i in range(pages):
        _arrow(ax, (wx, y), (mx - 0.35, y - 0.45), color=COLORS["write"], width=2.2)
        ax.text(wx + 0.3, y + 0.05, f"fi_writemsg: page {i}, immediate data = {i}", fontsize=7.5,
                ha="left", va="bottom", color=COLORS["write"])
        _arrow(ax, (mx + 0.35, y - 0.55), (tx, y - 0.75), color=COLORS["recv"], dashed=True)
        note(tx + 0.3, y - 0.75, f"CQ entry: FI_REMOTE_CQ_DATA,\ndata = {i}: page {i} has landed", color=COLORS["recv"])
        _arrow(ax, (mx - 0.35, y - 0.75), (wx, y - 1.05), color=COLORS["send"], width=0.9, dashed=True)
        note(wx - 0.3, y - 1.05, f"completion:\nwrite {i} done", ha="right", color=COLORS["send"])
        y -= 1.6
    note((mx + tx) / 2, y + 0.2, "chapter 6 waits for each\ncompletion before\nposting the next write",
         ha="center")
    y -= 0.6
    control(y, True, "DONE: N writes were posted")
    note(tx + 0.3, y - 0.6, "wait for N CQ entries,\ncompare every byte")
    control(y - 1.2, False, "REPORT: arrivals per page, verified")
    ax.text(mx, bottom - 0.2, "with an RDMA NIC the target's CPU touches no byte of the pages", fontsize=7.5, ha="center",
            va="top", color=COLORS["data"])
    legend = ("who posts?\n  only the writer: fi_writemsg names its own\n  bytes and the target's (base + offset,\n"
              "  key); the target posts nothing per write\n\n"
              "who completes?\n  the writer: its write is done, and the\n  context it posted comes back;\n"
              "  the target: a CQ entry, only because the\n  write carried FI_REMOTE_CQ_DATA\n\n"
              "what does the immediate data say?\n  which page landed (its index; the\n"
              "  provider carries 8 bytes on shm, 4 on EFA)")
    ax.text(20.4, 11.3, legend, fontsize=7.5, ha="left", va="top", linespacing=1.35,
            bbox=dict(boxstyle="round,pad=0.5", facecolor="#fbfbfb", edgecolor="#999999"))
    return fig


def gbps_comparison(rows: Sequence[tuple], line_rate: float | None = 100.0,
                    line_label: str = "one EFA link: 100 Gbps", title: str | None = None,
                    groups: Mapping[str, str] | None = None) -> Figure:
    """Horizontal bars of Gbps: ``rows`` are (label, gbps, group) or (label, gbps, group, note); groups pick
    the colour (``article``, ``here``, ``ceiling``) and ``groups`` maps them to legend text."""
    groups = dict(groups or {"article": "the article, AWS p5 (EFA)", "here": "measured here",
                             "ceiling": "this machine's ceiling"})
    palette = {"article": COLORS["recv"], "here": COLORS["send"], "ceiling": COLORS["control"]}
    rows = list(rows)
    height = 0.42 * len(rows) + 1.55
    fig = _figure(9, height)
    ax = fig.add_axes((0.36, 0.85 / height, 0.6, 1 - 1.3 / height))
    ys = list(range(len(rows)))[::-1]
    top = max([r[1] for r in rows] + [line_rate or 0])
    seen = set()
    for y, row in zip(ys, rows):
        label, gbps, group = row[:3]
        note = row[3] if len(row) > 3 else ""
        ax.barh(y, gbps, color=palette.get(group, "#999999"), height=0.6, zorder=2,
                label=groups.get(group, group) if group not in seen else None)
        seen.add(group)
        ax.text(gbps + top * 0.01, y, f"{gbps:.1f}" + (f"  {note}" if note else ""), va="center", fontsize=7.5,
                zorder=4, bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.85))
    if line_rate:
        ax.axvline(line_rate, color="black", ls="--", lw=1, zorder=3, label=line_label)
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("Gbps", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color=COLORS["grid"], zorder=0)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=4, frameon=False)
    if title:
        ax.set_title(title, fontsize=10, pad=10)
    return fig


# ---------------------------------------------------------------------------------------- chapter 7


def operation_queue(depth: int = 4) -> Figure:
    """Chapter 7's queue: writes wait in a deque, at most ``depth`` are posted at a time, completions free
    slots, -FI_EAGAIN leaves the head where it is. Below, why it matters: the link's busy time with one
    write in flight and with several."""
    fig = _figure(10, 6.4)
    ax = _canvas(fig, rect=(0, 0.42, 1, 0.58), xlim=(0, 20), ylim=(0, 7.9))
    _box(ax, 0.2, 4.4, 3.3, 1.5, "write_pages:\nsubmit one\noperation per page", COLORS["app"], fontsize=8)
    ax.text(6.9, 6.85, "pending (a deque, in order)", fontsize=8, ha="center")
    pending = ["w9", "w8", "w7", "w6"]
    for i, name in enumerate(pending):
        face = "#fdebd0" if i < len(pending) - 1 else "#f5b041"
        _box(ax, 4.6 + i * 1.15, 4.7, 1.0, 0.9, name, face, fontsize=8, style="square,pad=0")
    ax.text(4.6 + 3 * 1.15 + 0.5, 4.35, "head", fontsize=7, ha="center", va="top")
    _arrow(ax, (3.5, 5.15), (4.55, 5.15))
    ax.text(13.1, 4.35, f"in flight (at most depth = {depth})", fontsize=8, ha="center", va="top")
    for i in range(depth):
        _box(ax, 11.0 + i * 1.1, 4.7, 0.95, 0.9, f"w{5 - i}", COLORS["write"], fontsize=8, style="square,pad=0",
             text_color="white")
    _arrow(ax, (9.35, 5.15), (10.95, 5.15))
    ax.text(10.15, 5.45, "post\nfrom\nthe head", fontsize=7, ha="center", va="bottom")
    _box(ax, 16.2, 4.2, 3.5, 1.9, "provider / NIC\n(its own queue\nmay be full)", COLORS["nic"], fontsize=8)
    _arrow(ax, (15.45, 5.15), (16.15, 5.15))
    _box(ax, 11.0, 1.3, 4.3, 0.9, "completion queue: w1, w0", "#7dcea0", fontsize=8)
    _arrow(ax, (17.9, 4.2), (15.35, 1.75))
    _arrow(ax, (11.0, 1.75), (6.8, 1.75))
    _box(ax, 2.4, 1.1, 4.4, 1.3, "progress(): reap completions;\neach completed() frees a slot,\nthen post again",
         COLORS["app"], fontsize=7.5)
    _arrow(ax, (4.6, 2.4), (8.0, 4.65), color="#555555", connection="arc3,rad=-0.25")
    _arrow(ax, (17.9, 6.1), (8.3, 5.65), color="#a93226", dashed=True, connection="arc3,rad=0.2")
    ax.text(13.2, 7.55, "-FI_EAGAIN: the operation stays at the head and is tried again after the next "
            "round of completions", fontsize=7.5, color="#a93226", ha="center", va="center")

    # Below: the link with one write in flight, and with a queue.
    lx = fig.add_axes((0.16, 0.07, 0.8, 0.3))
    wire, trip, n = 1.0, 1.6, 6
    rows = {"chapter 6:\none in flight": [k * (wire + trip) for k in range(n)]}
    starts, done = [], []
    for k in range(n):
        start = max(starts[-1] + wire if starts else 0.0, done[k - depth] if k >= depth else 0.0)
        starts.append(start)
        done.append(start + wire + trip)
    rows[f"chapter 7:\n{depth} in flight"] = starts
    for y, (name, begins) in enumerate(reversed(list(rows.items()))):
        lx.broken_barh([(b, wire) for b in begins], (y - 0.3, 0.6), facecolors=COLORS["write"])
        for k, b in enumerate(begins):
            lx.text(b + wire / 2, y, f"w{k}", color="white", fontsize=7, ha="center", va="center")
        end = begins[-1] + wire + trip
        lx.plot([end], [y], marker="o", color=COLORS["send"], ms=5)
    lx.set_yticks([0, 1])
    lx.set_yticklabels(list(reversed(list(rows))), fontsize=8)
    lx.set_xlim(0, n * (wire + trip) + 0.5)
    lx.set_ylim(-0.7, 1.7)
    lx.set_xticks([])
    lx.set_xlabel("time → (purple: the link carries a page; gaps: it waits for a completion to come back; "
                  "dot: the last completion)", fontsize=7.5)
    for side in ("top", "right"):
        lx.spines[side].set_visible(False)
    return fig


def saturation_depth(gbps_by_depth: Mapping[int, float], share: float = 0.9) -> int:
    """The smallest depth whose rate reaches ``share`` of the best rate in the row."""
    best = max(gbps_by_depth.values())
    return min(d for d, g in gbps_by_depth.items() if g >= share * best)


def queue_sweep(results, ceiling_gbps: float | None = None, title: str | None = None,
                share: float = 0.9) -> Figure:
    """Gbps over page size × pages in flight (``results``: objects with page_size, in_flight, gbps, such as
    bench.BenchResult): a heat map and one curve per page size. Each row of the heat map is coloured by its
    share of that row's best, so rows of very different Gbps read alike. The framed cell / circled point of
    each row is the fewest pages in flight that reach ``share`` of that row's best: where the queue saturates."""
    grid: dict[int, dict[int, float]] = {}
    for r in results:
        grid.setdefault(r.page_size, {})[r.in_flight] = r.gbps
    pages = sorted(grid)
    depths = sorted({d for row in grid.values() for d in row})
    height = 0.55 * len(pages) + 2.6
    fig = _figure(11, height)
    hm = fig.add_axes((0.08, 0.85 / height, 0.38, 1 - 1.5 / height))
    cv = fig.add_axes((0.54, 0.85 / height, 0.33, 1 - 1.5 / height))
    best = {p: max(grid[p].values()) or 1.0 for p in pages}
    shares = [[grid[p][d] / best[p] if d in grid[p] else float("nan") for d in depths] for p in pages]
    hm.imshow(shares, cmap="Purples", vmin=0, vmax=1, aspect="auto", origin="lower")
    for i, p in enumerate(pages):
        knee = saturation_depth(grid[p], share)
        for j, d in enumerate(depths):
            g = grid[p].get(d)
            if g is None:
                continue
            hm.text(j, i, f"{g:.1f}", ha="center", va="center", fontsize=8,
                    color="white" if g > 0.6 * best[p] else "black")
            if d == knee:
                hm.add_patch(FancyBboxPatch((j - 0.46, i - 0.44), 0.92, 0.88, boxstyle="square,pad=0",
                                            facecolor="none", edgecolor=COLORS["send"], lw=2))
    hm.set_xticks(range(len(depths)))
    hm.set_xticklabels([str(d) for d in depths], fontsize=8)
    hm.set_yticks(range(len(pages)))
    hm.set_yticklabels([format_size(p) for p in pages], fontsize=8)
    hm.set_xlabel("pages in flight", fontsize=8)
    hm.set_ylabel("page size", fontsize=8)
    hm.set_title(f"Gbps; colour: share of the row's best;\nframed: first depth within {share:.0%} of it",
                 fontsize=8.5)
    palette = [COLORS["recv"], COLORS["send"], COLORS["write"], COLORS["data"], COLORS["control"]]
    top = max(best.values())
    for i, p in enumerate(pages):
        xs = sorted(grid[p])
        color = palette[i % len(palette)]
        cv.plot(xs, [grid[p][d] for d in xs], marker="o", color=color, label=format_size(p))
        knee = saturation_depth(grid[p], share)
        cv.plot([knee], [grid[p][knee]], marker="o", ms=13, mfc="none", mec=color, mew=1.5)
    if ceiling_gbps:
        cv.axhline(ceiling_gbps, color="black", ls="--", lw=1, label=f"memcpy\n{ceiling_gbps:.0f} Gbps")
    cv.set_xscale("log", base=2)
    cv.set_xticks(depths)
    cv.set_xticklabels([str(d) for d in depths], fontsize=8)
    cv.xaxis.set_minor_formatter(NullFormatter())
    cv.set_xlabel("pages in flight (log scale)", fontsize=8)
    cv.set_ylabel("Gbps", fontsize=8)
    cv.tick_params(axis="y", labelsize=8)
    cv.set_ylim(0, max(top, ceiling_gbps or 0) * 1.12)
    cv.grid(color=COLORS["grid"])
    cv.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="page size", title_fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10, y=0.995)
    return fig


# ---------------------------------------------------------------------------------------- chapter 8

_GROUP_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#7f7f7f"]


def pcie_tree(topo: Topology, ax: Any = None, *, labels: bool = True) -> Figure:
    """Draw a ``topology.Topology``'s PCIe tree: CPU sockets (NUMA nodes) at the top, host bridges and PCIe
    bridges below them, GPUs (squares) and NICs (circles) as leaves, each group in its own colour. Devices
    without a PCI address stand apart on the right. Returns the matplotlib Figure (a new one when ``ax`` is
    None)."""
    from matplotlib.lines import Line2D

    color_of: dict[tuple, str] = {}
    for i, g in enumerate(topo.groups):
        c = _GROUP_COLORS[i % len(_GROUP_COLORS)]
        if g.gpu is not None:
            color_of["gpu", g.gpu] = c
        for n in g.nics:
            color_of["nic", n] = c
    tree = _pcie_layout(topo)
    leaf_pos, loose, loose_x0 = tree["leaves"], tree["loose"], tree["loose_x0"]
    n_leaves = len(leaf_pos) + len(loose)
    if ax is None:
        fig = Figure(figsize=(max(6.0, 0.36 * n_leaves + 2.5), 5.2), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    many = n_leaves > 12
    pos = {p: (sum(v) / len(v), -tree["depth"][p]) for p, v in tree["xs"].items()}
    max_depth = max([d for *_, d in leaf_pos] + [2])
    for p, (px, py) in pos.items():
        if len(p) > 1:
            qx, qy = pos[p[:-1]]
            ax.plot([qx, px], [qy, py], color="#999999", lw=0.8, zorder=1)
    for leaf, path, lx, depth in leaf_pos:
        px, py = pos[path]
        ax.plot([px, lx], [py, -depth], color="#999999", lw=0.8, zorder=1)
    _pcie_inner_nodes(ax, topo, pos, tree["children"], labels and not many, labels)
    for (kind, key, label, addr), _, lx, depth in leaf_pos:
        label = label if many or not labels else f"{label}\n{addr[5:]}"
        _pcie_leaf(ax, lx, -depth, kind, label, color_of.get((kind, key), "#444444"), many)
    if loose:
        ax.text(loose_x0 + (len(loose) - 1) / 2, -1, "no PCI address:\nno place on the tree", ha="center",
                va="center", fontsize=8, bbox=dict(boxstyle="round", fc="#eeeeee", ec="#999999", ls="--"))
        for i, ((kind, key, label, _), _) in enumerate(loose):
            _pcie_leaf(ax, loose_x0 + i, -max_depth, kind, label, color_of.get((kind, key), "#444444"), many)
    ax.set_title(f"PCIe tree of {topo.title}", fontsize=10)
    ax.set_xlim(-1, max(loose_x0 + len(loose), tree["x"]) + 0.5 if tree["xs"] or loose else 1)
    ax.set_ylim(-max_depth - (2.4 if many else 1.0), 0.8)
    ax.axis("off")
    handles = [Line2D([], [], marker="s", ls="", color="#444444", label="GPU"),
               Line2D([], [], marker="o", ls="", color="#444444", label="NIC"),
               Line2D([], [], marker="D", ls="", color="#555555", label="host bridge"),
               Line2D([], [], marker="o", ls="", mfc="#bbbbbb", mec="#666666", label="PCIe bridge")]
    ax.legend(handles=handles, loc="lower right", fontsize=7, frameon=False, ncol=4)
    return fig


def _pcie_layout(topo: Topology) -> dict:
    """Where pcie_tree puts everything: leaves ((kind, key, label, pci address), path, x, depth) sorted by
    their path (NUMA node, host bridge, bridges) then address; "xs" the x of every leaf below each path
    prefix, "depth" each prefix's depth, "children" how many branches leave it; "loose" the devices with no
    place on the tree, drawn from "loose_x0" on."""
    leaves: list[tuple[str, Any, str, str | None]] = [("gpu", g.index, g.label, g.pci) for g in topo.gpus]
    leaves += [("nic", n.domain, n.device or n.domain, n.pci) for n in topo.nics]
    placed: list[tuple] = []
    loose: list[tuple] = []
    for leaf in leaves:
        d = topo.pci.get(leaf[3] or "")
        (placed if d is not None and d.found and d.host_bridge else loose).append((leaf, d))

    def node_of(d):
        return d.numa_node if d.numa_node is not None else "?"
    placed.sort(key=lambda ld: (str(node_of(ld[1])), ld[1].host_bridge, ld[1].bridges, ld[1].address))
    xs: dict[tuple, list[float]] = {}
    depth_of: dict[tuple, int] = {}
    leaf_pos = []
    x, last_top = 0.0, None
    for leaf, d in placed:
        top = node_of(d)
        if last_top is not None and top != last_top:
            x += 1.0  # a gap between sockets
        last_top = top
        path = (top, d.host_bridge, *d.bridges)
        for k in range(1, len(path) + 1):
            xs.setdefault(path[:k], []).append(x)
            depth_of[path[:k]] = k - 1
        leaf_pos.append((leaf, path, x, len(path)))
        x += 1.0
    for numa_node in topo.numa_nodes:  # sockets with no device below them still show
        if (numa_node.node,) not in xs:
            x += 1.0 if xs else 0.0
            xs[(numa_node.node,)], depth_of[(numa_node.node,)] = [x], 0
            x += 1.0
    children = Counter(p[:-1] for p in xs if len(p) > 1) + Counter(path for _, path, _, _ in leaf_pos)
    return {"leaves": leaf_pos, "loose": loose, "loose_x0": x + (1.0 if xs else 0.0), "xs": xs, "depth": depth_of,
            "children": children, "x": x}


def _pcie_inner_nodes(ax, topo, pos: dict, children: Counter, bridge_names: bool, labels: bool) -> None:
    """pcie_tree's sockets (boxes), host bridges (diamonds) and PCIe bridges (dots; a switch where it
    branches)."""
    for p, (px, py) in pos.items():
        if len(p) == 1:
            node = topo.numa_node(p[0]) if p[0] != "?" and any(n.node == p[0] for n in topo.numa_nodes) else None
            text = (f"CPU socket / NUMA {p[0]}\ncores {format_cpulist(node.cores)}" if node
                    else f"NUMA node {p[0]}")
            ax.text(px, py, text, ha="center", va="center", fontsize=8, zorder=3,
                    bbox=dict(boxstyle="round", fc="#f3e6c8", ec="#8a6d3b"))
        elif len(p) == 2:
            ax.scatter([px], [py], marker="D", s=40, color="#555555", zorder=2)
            if labels:
                ax.annotate(p[1], (px, py), textcoords="offset points", xytext=(6, 0), fontsize=6, va="center")
        else:
            ax.scatter([px], [py], marker="o", s=18, color="#bbbbbb", edgecolors="#666666", zorder=2)
            text = "PCIe switch" if children[p] > 1 else ""
            if bridge_names:
                text = f"{p[-1][5:]} {text}".strip()
            if text:
                ax.annotate(text, (px, py), textcoords="offset points", xytext=(5, 0), fontsize=6, va="center",
                            style="italic" if children[p] > 1 else "normal")


def _pcie_leaf(ax, x: float, y: float, kind: str, label: str, color: str, many: bool) -> None:
    ax.scatter([x], [y], marker="s" if kind == "gpu" else "o", s=110 if kind == "gpu" else 50, color=color,
               edgecolors="black", linewidths=0.6, zorder=3)
    ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, -8), ha="center", va="top",
                rotation=90 if many else 0, fontsize=7 if many else 8)


# ----------------------------------------------------------------------------------- chapters 9-15


def spread_panels(panels: Sequence[tuple], xlabel: str, title: str | None = None, log_x: bool = False) -> Figure:
    """Lessons 09-15's mechanism measurements, one panel per quantity. ``panels``: (ylabel, series) where
    series maps a legend label to {x: [measurements]}; each point is the median with a bar from min to max
    (x may be numbers, or names drawn in order). A log scale suits NIC, thread and batch counts."""
    width = 4.2 * len(panels) + 0.6
    fig = _figure(width, 3.4)
    palette = [COLORS["send"], COLORS["recv"], COLORS["write"], COLORS["data"], COLORS["control"]]
    for i, (ylabel, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for k, (name, points) in enumerate(series.items()):
            xs = list(points)
            where = xs if all(isinstance(x, (int, float)) for x in xs) else list(range(len(xs)))
            values = [sorted(points[x]) for x in xs]
            medians = [v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2 for v in values]
            low = [m - v[0] for m, v in zip(medians, values)]
            high = [v[-1] - m for m, v in zip(medians, values)]
            color = palette[k % len(palette)]
            ax.errorbar(where, medians, yerr=[low, high], marker="o", ms=5, capsize=3, color=color,
                        label=name if len(series) > 1 else None)
            if where is not xs:
                ax.set_xticks(where)
                ax.set_xticklabels([str(x) for x in xs], fontsize=8)
            elif log_x:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs)
                ax.set_xticklabels([str(x) for x in xs], fontsize=8)
                ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(color=COLORS["grid"])
        if len(series) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title + "  (median; bars: min to max)", fontsize=9.5)
    fig.tight_layout()
    return fig
