"""`ruff check .` with the project's configuration (pyproject.toml [tool.ruff]) passes: pyflakes,
import order and line length hold in every file, product code, tests and benchmarks alike. Product
modules import only from their own layer and those below it, none is over 500 lines and no
function in them over 60."""

import ast
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    done = subprocess.run(cmd + ["check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# The layers, lowest first: a module may import from its own layer and the ones before it. eval/
# gets what it needs from the run passed in (ARCHITECTURE.md), so it never reaches up into trainer/.
LAYERS = ["models", "data_pipeline", "eval", "trainer"]


def _imported_layers(path):
    import ast

    package = ["tandem"] + os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # `from ..trainer import x` counts as `tandem.trainer`
            base = package[: len(package) - node.level + 1] if node.level else []
            names = [".".join(base + ([node.module] if node.module else []))]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tandem" and len(parts) > 1 and parts[1] in LAYERS:
                yield parts[1], node.lineno


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        for folder, _, files in os.walk(os.path.join(ROOT, layer)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    wrong += [f"{os.path.relpath(path, ROOT)}:{line} imports tandem.{up}"
                              for up, line in _imported_layers(path) if LAYERS.index(up) > rank]
    assert not wrong, "\n".join(wrong)


MAX_PRODUCT_LINES = 500
"""Files a reader can hold (ARCHITECTURE.md): no product module over 500 lines."""


def _product_files():
    return [os.path.join(dirpath, name)
            for layer in LAYERS + ["slurm"]
            for dirpath, _, names in os.walk(os.path.join(ROOT, layer))
            for name in names if name.endswith(".py")]


def test_no_product_file_is_over_500_lines():
    product = _product_files()
    assert len(product) > 50  # the walk found the package
    long = {os.path.relpath(p, ROOT): n for p in product
            if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_PRODUCT_LINES}
    assert not long, f"over {MAX_PRODUCT_LINES} lines (split them): {long}"


MAX_FUNCTION_LINES = 60
"""A function a reader can follow: at most 60 lines of body after its docstring (ARCHITECTURE.md;
a table longer than that would be data, named here if one ever needs to be)."""


def _function_lengths(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (len(body) > 1 and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]  # the docstring
            yield node.name, node.lineno, node.end_lineno - body[0].lineno + 1


def test_no_product_function_is_over_60_lines():
    long = [f"{os.path.relpath(path, ROOT)}:{line} {func} ({n} lines)"
            for path in _product_files()
            for func, line, n in _function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, "split them:\n" + "\n".join(long)
