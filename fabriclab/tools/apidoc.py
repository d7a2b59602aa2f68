"""The API reference of ``fabriclab.Engine`` and ``fabriclab.bootstrap``, rendered from the docstrings.

    python -m fabriclab.tools.apidoc build/API.md      # or: python -m fabriclab apidoc build/API.md

What is documented: the module docstring of ``fabriclab.engine``; every name of ``fabriclab.__all__``
(the engine, its regions, peers, transfers, results and errors) with its signature, docstring, bases,
instance attributes and its own public methods and properties; then ``fabriclab.bootstrap`` and its
public classes and functions. Everything comes from ``inspect``: nothing is written by hand, so the
reference cannot drift from the code.

The reference rule. A docstring names things in double backticks (````name````) or with a role
(``:class:`Name```, also ``:func:``, ``:meth:``, ``:attr:``, ``:exc:``, ``:mod:``). When that text looks
like a Python name -- a dotted identifier, optionally followed by a call ``(...)`` or a subscript
``[...]`` -- its dotted part must resolve, or the build fails (exit status 1, naming the docstring and the
reference). Anything else in backticks (a path, a literal, an expression) is prose and is not checked.
A name resolves when its first part is

  1. a parameter of the documented function or method (then it must stand alone),
  2. an attribute of the class that owns the docstring: a class attribute, method, property, dataclass
     field, or an instance attribute assigned as ``self.NAME = ...`` in the class's (or a fabriclab
     base class's) source; a module docstring may name attributes of any class it documents,
  3. a name of the documented module, or of ``fabriclab`` itself, or an importable module;

and each further part is an attribute (in the sense of 2) of what the previous part named. Dunder names
such as ``__dlpack__`` are Python protocols and are accepted as they are.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import pathlib
import re
import sys
import textwrap
from dataclasses import dataclass, field

#: The modules whose public objects make the reference, in order.
MODULES = ("fabriclab.engine", "fabriclab.bootstrap")
ROLES = ("class", "func", "meth", "attr", "exc", "mod")
_REFERENCE = re.compile(r"``(?P<plain>[^`]+?)``|:(?P<role>" + "|".join(ROLES) + r"):`(?P<target>[^`]+)`")
_NAME = re.compile(r"(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\)|\[.*\])?")
_DUNDER = re.compile(r"__\w+__")
_MISSING = object()


@dataclass
class Doc:
    """One docstring to render and check: who owns it, and the names it may refer to."""
    qualname: str
    text: str
    module: object
    owner: type | None = None                  # the class of a class or method docstring
    params: set = field(default_factory=set)   # parameters of the documented callable
    classes: tuple = ()                        # for a module docstring: the classes it documents


# ------------------------------------------------------------------------------------- introspection


def public_objects(module) -> list[tuple[str, object]]:
    """(name, object) of a module's public API: ``__all__`` when it has one, else the public classes and
    functions defined in it."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items() if not n.startswith("_")
                 and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__]
    return [(n, getattr(module, n)) for n in names]


def instance_attributes(cls: type) -> list[str]:
    """Names assigned as ``self.NAME = ...`` (also ``self.a, self.b = ...``) in the source of ``cls`` and
    of its fabriclab base classes, in order of appearance."""
    seen: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("fabriclab"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            assign = re.search(r"(?<![=!<>+\-*/%&|^:])=(?!=)", line)
            if assign:
                for name in re.findall(r"\bself\.([A-Za-z_]\w*)", line[:assign.start()]):
                    seen.setdefault(name, None)
    return list(seen)


def class_names(cls: type) -> set[str]:
    """Every name rule 2 of the module docstring accepts for ``cls``."""
    names = set(dir(cls)) | set(instance_attributes(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def own_members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties defined in ``cls`` itself (not inherited), in source order."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            out.append((name, value))
    return out


def signature(obj, drop_self: bool = False) -> str:
    """``(a: int, *, b=1) -> X`` with annotations evaluated where possible."""
    try:
        try:
            sig = inspect.signature(obj, eval_str=True)
        except Exception:  # an annotation that does not evaluate here: keep the text
            sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if drop_self:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    if inspect.isclass(obj):
        sig = sig.replace(return_annotation=inspect.Signature.empty)
    text = str(sig)
    text = re.sub(r"(: )'([^']*)'", r"\1\2", text)  # forward references written as strings
    return text.replace("concurrent.futures._base.", "concurrent.futures.")


def qualified(cls: type) -> str:
    """How a class is named in the reference: bare for fabriclab's and builtins, else module.name."""
    module = cls.__module__.replace("concurrent.futures._base", "concurrent.futures")
    if module == "builtins" or module.startswith("fabriclab"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def anchor(heading: str) -> str:
    """The anchor GitHub and most Markdown renderers give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def parameters(obj) -> set[str]:
    try:
        return set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return set()


# ----------------------------------------------------------------------------------- the rule


def references(text: str) -> list[str]:
    """The text of every ````name```` and ``:role:`name``` reference of a docstring."""
    return [m.group("plain") or m.group("target") for m in _REFERENCE.finditer(text or "")]


def _lookup(obj, name: str):
    """The attribute ``name`` of ``obj``; True when it exists but holds no object (an instance attribute)."""
    if inspect.isclass(obj) and name in class_names(obj):
        return getattr(obj, name, True)
    if inspect.ismodule(obj):
        if hasattr(obj, name):
            return getattr(obj, name)
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            return _MISSING
    return getattr(obj, name, _MISSING)


def _first(name: str, doc: Doc):
    """What the first part of a reference names in this docstring's scope, or _MISSING."""
    scopes = []
    if doc.owner is not None:
        scopes.append(doc.owner)
    scopes.extend(doc.classes)
    for scope in scopes:
        found = _lookup(scope, name)
        if found is not _MISSING:
            return found
    for module in (doc.module, importlib.import_module("fabriclab")):
        found = getattr(module, name, _MISSING)
        if found is not _MISSING:
            return found
    try:
        return importlib.import_module(name)
    except ImportError:
        return _MISSING


def resolves(reference: str, doc: Doc) -> bool:
    """Whether a reference satisfies the rule (text that is not a Python name always does)."""
    match = _NAME.fullmatch(reference.strip())
    if match is None:
        return True  # not a name: prose such as a path or a literal
    parts = match.group("path").split(".")
    if len(parts) == 1 and (_DUNDER.fullmatch(parts[0]) or parts[0] in doc.params):
        return True
    obj = _first(parts[0], doc)
    for part in parts[1:]:
        if obj is _MISSING or obj is True:
            return False
        obj = _lookup(obj, part)
    return obj is not _MISSING


def unresolved(doc: Doc) -> list[str]:
    return [ref for ref in references(doc.text) if not resolves(ref, doc)]


# ----------------------------------------------------------------------------------------- render


def markdown(text: str | None) -> str:
    """A docstring as Markdown: roles and double backticks become code spans, indented blocks fences."""
    if not text:
        return "*(undocumented)*"
    out = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        lines = block.splitlines()
        if lines and all(line.startswith("    ") or not line.strip() for line in lines):
            out.append("```python\n" + textwrap.dedent(block) + "\n```")
        else:
            block = _REFERENCE.sub(lambda m: f"`{m.group('plain') or m.group('target')}`", block)
            out.append(block)
    return "\n\n".join(out)


class Reference:
    """Collects the Markdown and every docstring it rendered (for the reference check)."""

    def __init__(self):
        self.lines: list[str] = []
        self.docs: list[Doc] = []
        self.undocumented: list[str] = []

    def doc(self, doc: Doc) -> None:
        self.docs.append(doc)
        if not doc.text:
            self.undocumented.append(doc.qualname)
        self.lines += [markdown(doc.text), ""]

    def module(self, module) -> None:
        objects = public_objects(module)
        classes = tuple(obj for _, obj in objects if inspect.isclass(obj))
        self.lines += [f"## `{module.__name__}`", ""]
        self.doc(Doc(module.__name__, module.__doc__, module, classes=classes))
        for name, obj in objects:
            if inspect.isclass(obj):
                self.klass(name, obj, module)
            elif callable(obj):
                self.function(name, obj, module)

    def klass(self, name: str, cls: type, module) -> None:
        self.lines += [f"### class `{name}`", "", "```python", f"{name}{signature(cls)}", "```", ""]
        bases = [b for b in cls.__bases__ if b is not object]
        if bases:
            shown = ", ".join(f"`{qualified(b)}`" for b in bases)
            self.lines += [f"*Bases:* {shown}", ""]
        self.doc(Doc(f"{module.__name__}.{name}", cls.__doc__, module, owner=cls,
                     params=parameters(cls)))
        facts = []
        if dataclasses.is_dataclass(cls):
            facts.append("*Fields:* " + ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls)))
        attributes = [a for a in instance_attributes(cls) if not a.startswith("_")
                      and not isinstance(inspect.getattr_static(cls, a, None), property)]
        if attributes:
            facts.append("*Instance attributes:* " + ", ".join(f"`{a}`" for a in attributes))
        if "__await__" in vars(cls):
            facts.append(f"*Awaitable:* `await` a `{name}` under asyncio.")
        if "__enter__" in vars(cls):
            facts.append("*Context manager:* `with ...` closes it on exit.")
        for fact in facts:
            self.lines += [fact, ""]
        for member, value in own_members(cls):
            if isinstance(value, property):
                self.lines += [f"#### `{name}.{member}` *(property)*", ""]
                self.doc(Doc(f"{module.__name__}.{name}.{member}", value.__doc__, module, owner=cls))
            else:
                self.lines += [f"#### `{name}.{member}`", "", "```python",
                               f"{member}{signature(value, drop_self=True)}", "```", ""]
                self.doc(Doc(f"{module.__name__}.{name}.{member}", value.__doc__, module, owner=cls,
                             params=parameters(value)))

    def function(self, name: str, func, module) -> None:
        self.lines += [f"### `{name}`", "", "```python", f"{name}{signature(func)}", "```", ""]
        self.doc(Doc(f"{module.__name__}.{name}", func.__doc__, module, params=parameters(func)))

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


def build() -> tuple[str, list[str], list[str]]:
    """(Markdown, problems, undocumented): problems name each docstring and each reference that breaks
    the rule; an empty list means the reference is sound."""
    import fabriclab
    ref = Reference()
    ref.lines += ["# fabriclab API reference", "",
                  f"fabriclab {fabriclab.__version__}. Generated from the docstrings by `python -m fabriclab.tools.apidoc` "
                  "(do not edit by hand). `from fabriclab import Engine, ...` gives every name of "
                  "`fabriclab.engine` below.", ""]
    modules = [importlib.import_module(name) for name in MODULES]
    ref.lines += ["Contents:", ""]
    for module in modules:
        ref.lines.append(f"- [`{module.__name__}`](#{anchor(module.__name__)})")
        for name, obj in public_objects(module):
            heading = f"class {name}" if inspect.isclass(obj) else name
            ref.lines.append(f"  - [`{name}`](#{anchor(heading)})")
    ref.lines.append("")
    for module in modules:
        ref.module(module)
    problems = [f"{doc.qualname}: ``{r}`` does not resolve" for doc in ref.docs for r in unresolved(doc)]
    return ref.text(), problems, ref.undocumented


# ---------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", nargs="?", default="build/API.md",
                        help="Markdown file to write ('-': standard output; default %(default)s)")


def main(args) -> int:
    text, problems, undocumented = build()
    if problems:
        print(f"apidoc: {len(problems)} docstring reference(s) do not resolve (the rule is at the top of "
              "fabriclab/apidoc.py):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    for name in undocumented:
        print(f"apidoc: warning: {name} has no docstring", file=sys.stderr)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"apidoc: wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m fabriclab.tools.apidoc", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
