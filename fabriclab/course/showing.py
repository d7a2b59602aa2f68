"""What the lessons show: code and diffs from the modules, the fabric a lesson runs on, two endpoints in
one process (``fabriclab.course.lesson`` re-exports every name).

* ``show_source(obj)`` / ``show_diff(old, new)``: a stage's code, and what changed since the previous
  stage, straight from the modules (the library is the single source of truth; notebooks never copy code).
  In IPython they render as Markdown code blocks, elsewhere they are printed.
* ``fabric()`` / ``stage_args()``: which provider and domain a lesson runs on (IP-based providers are
  pinned to the loopback interface: a lesson never sends traffic off this host).
* ``LocalPair``: two endpoints in one process, for small demonstrations of posting and completing
  operations without a second process, with a ``Trace`` of when each operation was posted and completed.
"""
from __future__ import annotations

import difflib
import inspect
import pathlib
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import fi

# Providers that run over IP: a lesson pins them to the loopback interface.


# ------------------------------------------------------------------------------------- showing code


def in_ipython() -> bool:
    """True inside a Jupyter kernel or an IPython shell (where rich display works)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _where(obj) -> str:
    """'fabriclab/unidirectional.py: Sender.send' for an object whose source we can find."""
    try:
        path = pathlib.Path(inspect.getsourcefile(obj) or "?")
    except TypeError:
        return repr(obj)
    package = pathlib.Path(__file__).resolve().parents[1]  # the fabriclab package, wherever it was checked out
    try:
        shown = "fabriclab/" + path.resolve().relative_to(package).as_posix()
    except ValueError:
        shown = path.name
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    return f"{shown}: {name}" if name and not inspect.ismodule(obj) else shown


def source(obj) -> str:
    """The source text of a module, class, function or method (dedented); a str is returned as is."""
    if isinstance(obj, str):
        return obj
    return textwrap.dedent(inspect.getsource(obj))


def label(obj) -> str:
    """How an object is named in headings and diff headers."""
    return "text" if isinstance(obj, str) else _where(obj)


def diff(old, new, context: int = 3, names: tuple[str, str] | None = None) -> str:
    """Unified diff from ``old``'s source to ``new``'s (each an object, or a str taken as the text);
    ``names`` overrides the two headers."""
    old_text, new_text = source(old), source(new)
    old_name, new_name = names or (label(old), label(new))
    lines = difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), fromfile=old_name,
                                 tofile=new_name, n=context, lineterm="")
    return "\n".join(lines)


def _fence(text: str) -> str:
    """A backtick fence longer than any run of backticks inside ``text``."""
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def show_code(text: str, language: str = "python", title: str | None = None) -> None:
    """Display ``text`` as a code block: Markdown in IPython, plain text elsewhere."""
    if in_ipython():
        from IPython.display import Markdown, display
        fence = _fence(text)
        heading = f"**{title}**\n\n" if title else ""
        display(Markdown(f"{heading}{fence}{language}\n{text.rstrip()}\n{fence}"))
    else:
        if title:
            print(f"--- {title}")
        print(text.rstrip())


def show_source(obj, title: str | None = None) -> None:
    """Show the source of a module, class, function or method, headed by where it lives."""
    show_code(source(obj), "python", title or label(obj))


def show_diff(old, new, context: int = 3, title: str | None = None, names: tuple[str, str] | None = None) -> None:
    """Show what changed from ``old`` to ``new`` (e.g. one stage's ``serve`` and the next one's)."""
    old_name, new_name = names or (label(old), label(new))
    text = diff(old, new, context, (old_name, new_name))
    show_code(text or f"(no differences between {old_name} and {new_name})", "diff",
              title or f"{old_name} → {new_name}")


# ------------------------------------------------------------------------------- choosing a fabric

#: (provider, domain) for a lesson on this host; written once, in the binding, for the examples too.
fabric = fi.same_host_fabric


def stage_args(provider: str, domain: str | None = None) -> list[str]:
    """The ``--provider``/``--domain`` options that make a stage's server use the same fabric."""
    return ["--provider", provider] + (["--domain", domain] if domain else [])


# ------------------------------------------------------------------------ two endpoints, one process


@dataclass
class Op:
    """One posted operation as the trace saw it (times from LocalPair.clock, in seconds)."""
    token: Any
    side: str            # "receiver" or "sender"
    kind: str            # "recv", "send", "write"
    length: int
    posted: float        # the post call was entered
    returned: float      # the post call returned (the operation is now the provider's)
    refusals: int = 0    # how many times the provider answered -FI_EAGAIN first
    completed: float | None = None  # the completion was read from the queue
    completion_length: int | None = None


@dataclass
class Trace:
    """Posts and completions, keyed by the token each operation carries, and the polls that found them
    (``polls``: (start, end, completions) of every poll that read at least one completion)."""
    ops: dict = field(default_factory=dict)
    polls: list = field(default_factory=list)

    def posted(self, op: Op) -> None:
        if op.token in self.ops:
            raise fi.UsageError(f"token {op.token!r} is already in flight: give every operation its own")
        self.ops[op.token] = op

    def completed(self, token, when: float, length: int) -> None:
        op = self.ops.get(token)
        if op is not None:
            op.completed, op.completion_length = when, length

    @property
    def pending(self) -> list[Op]:
        return [op for op in self.ops.values() if op.completed is None]

    def clear(self) -> None:
        self.ops.clear()
        self.polls.clear()

    def rows(self) -> list[Op]:
        return sorted(self.ops.values(), key=lambda op: op.posted)


class LocalPair:
    """Two endpoints on one fabric in this process: ``receiver`` and ``sender``, which knows the
    receiver's address. Each has one registered buffer of ``size`` bytes.

    Nobody else polls here, and software providers only make progress while someone polls, so every
    method that waits polls *both* completion queues. ``trace`` records when each operation was posted
    and when its completion was read.
    """

    def __init__(self, provider: str | None = None, domain: str | None = None, size: int = 1 << 20,
                 timeout: float = fi.DEFAULT_TIMEOUT):
        if domain is None:
            provider, domain = fabric(provider)  # IP-based providers stay on the loopback interface
        self.timeout = timeout
        self.receiver = fi.open_endpoint(provider, domain)
        try:
            self.sender = fi.open_endpoint(provider, domain)
            # Zero-filled explicitly so every page is touched now, not during the first transfer.
            self.inbox = np.empty(size, dtype=np.uint8)
            self.outbox = np.empty(size, dtype=np.uint8)
            self.inbox.fill(0)
            self.outbox.fill(0)
            self.inbox_mr = self.receiver.register(self.inbox)
            self.outbox_mr = self.sender.register(self.outbox)
            self.dest = self.sender.av.insert(self.receiver.ep.address())
        except BaseException:
            self.close()
            raise
        self.info = self.sender.info
        self.trace = Trace()
        # The trace's clock: on the modeled host (the sim provider in modeled time) this thread's modeled clock,
        # which is what a post, a wait and a handshake cost there; elsewhere time.perf_counter.
        modeled = self.sender.cq.modeled_clock()
        self.clock: Callable[[], float] = (lambda: modeled() / 1e9) if modeled else time.perf_counter

    # -- polling

    def poll(self) -> int:
        """Read both completion queues once; returns how many completions of traced operations arrived."""
        now = self.clock
        start = now()
        seen = 0
        for stack in (self.receiver, self.sender):
            for c in stack.cq.poll():
                if c.token is not None:
                    self.trace.completed(c.token, now(), c.length)
                    seen += 1
        if seen:
            self.trace.polls.append((start, now(), seen))
        return seen

    def wait(self, done: Callable[[], bool] | None = None, timeout: float | None = None) -> None:
        """Poll until ``done()`` (default: nothing traced is pending); FabricTimeout after ``timeout``."""
        done = done or (lambda: not self.trace.pending)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            self.poll()
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"{len(self.trace.pending)} operation(s) completing", timeout)

    # -- posting

    def _post(self, attempt: Callable[[], bool], token, side: str, kind: str, length: int,
              retry: bool = True) -> bool:
        """Post with ``attempt`` (a try_post_* call); on -FI_EAGAIN poll and retry, unless ``retry`` is
        False, in which case return False and record nothing."""
        start = self.clock()
        refusals = 0
        deadline = time.monotonic() + self.timeout
        while not attempt():
            if not retry:
                return False
            refusals += 1
            self.poll()
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"posting a {kind}", self.timeout, "the provider kept answering -FI_EAGAIN")
        self.trace.posted(Op(token, side, kind, length, start, self.clock(), refusals))
        return True

    def post_recv(self, token, length: int | None = None, offset: int = 0, retry: bool = True) -> bool:
        """The receiver posts a receive of up to ``length`` bytes (default: the rest of its buffer)."""
        length = self.inbox.size - offset if length is None else length
        return self._post(lambda: self.receiver.ep.try_post_recv(self.inbox_mr, offset, length, token),
                          token, "receiver", "recv", length, retry)

    def post_send(self, token, length: int, offset: int = 0, retry: bool = True) -> bool:
        """The sender posts a send of ``length`` bytes of its buffer from ``offset``."""
        return self._post(lambda: self.sender.ep.try_post_send(self.outbox_mr, offset, length, self.dest, token),
                          token, "sender", "send", length, retry)

    def post_write(self, token, length: int, offset: int = 0, remote_offset: int = 0,
                   retry: bool = True) -> bool:
        """The sender RDMA-writes ``length`` bytes into the receiver's buffer (one-sided: the receiver
        posts nothing and sees no completion)."""
        remote = self.inbox_mr.remote()
        return self._post(lambda: self.sender.ep.try_post_write(self.outbox_mr, offset, length, self.dest, remote,
                                                                remote_offset, token),
                          token, "sender", "write", length, retry)

    # -- a tiny fi_rma_bw

    def write_bandwidth(self, size: int, window: int = 64, count: int = 1000) -> float:
        """Bytes per second of ``count`` RDMA writes of ``size`` bytes, ``window`` of them in flight
        (like fabtests' fi_rma_bw, but both ends share this one thread). Untraced."""
        if not 0 < size <= min(self.outbox.size, self.inbox.size):
            raise fi.UsageError(f"{size}-byte writes do not fit the pair's {self.outbox.size}-byte buffers")
        slots = max(1, min(window, self.outbox.size // size, self.inbox.size // size))
        remote = self.inbox_mr.remote()
        posted = done = 0
        start = self.clock()
        deadline = time.monotonic() + self.timeout
        while done < count:
            while posted < count and posted - done < window:
                slot = posted % slots
                if not self.sender.ep.try_post_write(self.outbox_mr, slot * size, size, self.dest, remote,
                                                     slot * size, ("bw", posted)):
                    break
                posted += 1
            self.receiver.cq.poll()
            done += len(self.sender.cq.poll())
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"{count} writes of {size} bytes", self.timeout)
        return size * count / (self.clock() - start)

    # -- lifetime

    def close(self) -> None:
        for name in ("sender", "receiver"):
            stack = getattr(self, name, None)
            if stack is not None:
                stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

