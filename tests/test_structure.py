"""One concern per module, held to numbers (GUIDE.md's style, issue 24): no Python module in fabriclab/ over
700 lines (course/figures.py, one figure per chapter, excepted), no function over 80 lines, no class over
300, and no C file in native/ over 700 lines."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fabriclab"
NATIVE = ROOT / "native"

MODULE_LINES, FUNCTION_LINES, CLASS_LINES, C_LINES = 700, 80, 300, 700
#: Longer by design: one figure per chapter (its functions are still held to FUNCTION_LINES).
LONG_MODULES = {"course/figures.py"}


def _sizes(path: pathlib.Path):
    """(kind, name, lines) of every function and class in a Python file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield kind, f"{node.name} (line {node.lineno})", node.end_lineno - node.lineno + 1


def _python_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path


def test_no_python_module_is_too_long():
    long = [f"fabriclab/{name}: {lines} lines" for name, path in _python_files() if name not in LONG_MODULES
            and (lines := len(path.read_text().splitlines())) > MODULE_LINES]
    assert not long, f"modules over {MODULE_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_no_function_or_class_is_too_long():
    limits = {"function": FUNCTION_LINES, "class": CLASS_LINES}
    long = [f"fabriclab/{name}: {kind} {what}: {lines} lines" for name, path in _python_files()
            for kind, what, lines in _sizes(path) if lines > limits[kind]]
    assert not long, (f"functions over {FUNCTION_LINES} lines or classes over {CLASS_LINES} (split them):\n"
                      + "\n".join(long))


def test_no_c_file_is_too_long():
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for path in sorted(NATIVE.rglob("*.c"))
            if (lines := len(path.read_text().splitlines())) > C_LINES]
    assert not long, f"C files over {C_LINES} lines (one file per object type):\n" + "\n".join(long)


def test_the_limits_see_what_they_measure():
    # The checks above pass vacuously if they find no file or measure nothing: check them on known shapes.
    names = {name for name, _ in _python_files()}
    assert {"measure.py", "topology/__init__.py", "tools/bench.py", "course/figures.py"} <= names
    sizes = {what.split(" ")[0]: lines for _, what, lines in _sizes(PACKAGE / "measure.py")}
    assert sizes["gbps"] > 1 and sizes["verdict"] > 1
    assert any(NATIVE.rglob("*.c"))
