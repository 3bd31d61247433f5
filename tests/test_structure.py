"""The rules of tpx's Python package, checked on its source (docs/design.md, "Where the code
lives"): no import cycle; only ``tpx.ops`` calls ``torch.ops.tpx``; only ``tpx._ext`` imports
the compiled extension; no module reaches into another's underscore names; no file over 600
lines; and every ``tpx.*`` name README.md and docs/ mention still resolves."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
from typing import Dict, Iterator, List, Set, Tuple

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "tpx"
MAX_LINES = 600


def _modules() -> Dict[str, Tuple[pathlib.Path, List[str]]]:
    """Dotted module name -> (file, the package its relative imports start from)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            package = parts
        else:
            package = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


MODULES = _modules()


def _trees() -> Iterator[Tuple[str, pathlib.Path, ast.AST]]:
    for name, (path, _) in MODULES.items():
        yield name, path, ast.parse(path.read_text(), str(path))


def _imported(name: str, node: ast.ImportFrom) -> Tuple[str, List[str]]:
    """(the module ``node`` imports from, the names it takes), resolved to dotted names."""
    if node.level:
        package = MODULES[name][1]
        base = package[:len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return target, [a.name for a in node.names]


def _edges() -> Dict[str, Set[str]]:
    """Module -> the tpx modules it imports, anywhere in it (function bodies included). Taking
    a submodule from its package (``from . import ops``) is an edge to the submodule; importing
    a module of another package (``tpx.nn.linear`` from ``tpx.sharding``) is also an edge to
    that package's ``__init__``, which Python runs first (the root package ``tpx`` aside:
    importing any module runs it, and it imports everything)."""
    graph: Dict[str, Set[str]] = {}
    for name, _, tree in _trees():
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target, names = _imported(name, node)
                for n in names:
                    if f"{target}.{n}" in MODULES:
                        out.add(f"{target}.{n}")
                    elif n != "_C" and target in MODULES:
                        out.add(target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in MODULES)
        for target in list(out):
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in MODULES and not (name == package or
                                               name.startswith(package + ".")):
                    out.add(package)
        out.discard(name)
        graph[name] = out
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_rule_checks_see_the_package():
    # The checks below are only as good as what they read: the package and its layers.
    for name in ("tpx", "tpx.ops", "tpx.ops.core", "tpx.mappings", "tpx._ext", "tpx.nn.linear",
                 "tpx.parallel.style", "tpx.checkpoint"):
        assert name in MODULES, name
    assert "tpx.nn.linear" in _edges()["tpx.parallel.style"] or \
        "tpx.nn" in _edges()["tpx.parallel.style"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(_edges()) == []


@pytest.mark.slow
def test_every_module_imports_first_and_alone():
    """Each module of the package imported first, as if ``tpx/__init__.py`` imported it before
    anything else (the package is registered without running its ``__init__``; subpackages
    run theirs): no import order of ``__init__`` hides a cycle."""
    import subprocess
    import sys

    # torch is imported once; each module is then imported in a forked child, in which no
    # tpx module was imported before (a fresh interpreter per module would take minutes).
    script = (
        "import importlib, os, sys, traceback\n"
        "import torch, torch.distributed\n"
        "failed = []\n"
        "for name in sys.argv[2:]:\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(r)\n"
        "        try:\n"
        "            import importlib.util\n"
        "            spec = importlib.util.spec_from_file_location(\n"
        "                'tpx', os.path.join(sys.argv[1], '__init__.py'),\n"
        "                submodule_search_locations=[sys.argv[1]])\n"
        "            sys.modules['tpx'] = importlib.util.module_from_spec(spec)\n"
        "            importlib.import_module(name)\n"
        "            os._exit(0)\n"
        "        except BaseException as e:\n"
        "            os.write(w, f'{type(e).__name__}: {e}'.encode()[:2000])\n"
        "            os._exit(1)\n"
        "    os.close(w)\n"
        "    with os.fdopen(r) as f:\n"
        "        message = f.read()\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    if status:\n"
        "        failed.append(f'{name}: {message}')\n"
        "print('\\n'.join(failed))\n")
    names = sorted(n for n in MODULES if n != "tpx" and not n.endswith("__main__"))
    done = subprocess.run([sys.executable, "-c", script, str(PACKAGE), *names],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout


def test_the_top_of_the_package_is_small_and_holds_no_alias_files():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    aliases = [str(path.relative_to(ROOT)) for path, _ in MODULES.values()
               if "sys.modules[__name__]" in path.read_text()]
    assert aliases == []


def _is_torch_ops_tpx(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "tpx"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "ops"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch")


def test_only_tpx_ops_calls_torch_ops_tpx():
    outside = sorted({name for name, _, tree in _trees()
                      if not (name == "tpx.ops" or name.startswith("tpx.ops."))
                      and any(_is_torch_ops_tpx(n) for n in ast.walk(tree))})
    assert outside == []


def test_only_tpx_ops_calls_the_kernels_directly():
    # `_ext.direct` (the kernels without the dispatcher) is the operators' other entry point.
    def uses_direct(tree):
        return any((isinstance(n, ast.Attribute) and n.attr == "direct"
                    and isinstance(n.value, ast.Name) and n.value.id == "_ext")
                   or (isinstance(n, ast.ImportFrom) and any(a.name == "direct" for a in n.names))
                   for n in ast.walk(tree))

    users = sorted({name for name, _, tree in _trees() if uses_direct(tree)})
    assert users and all(u == "tpx._ext" or u.startswith("tpx.ops.") for u in users), users


def test_only_tpx_ext_imports_the_extension():
    importers = set()
    for name, _, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target, names = _imported(name, node)
                if target == "tpx._C" or (target == "tpx" and "_C" in names):
                    importers.add(name)
            elif isinstance(node, ast.Import) and any(a.name == "tpx._C" for a in node.names):
                importers.add(name)
    assert importers == {"tpx._ext"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_underscore_names():
    found = []
    for name, _, tree in _trees():
        module_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target, names = _imported(name, node)
                for alias in node.names:
                    if f"{target}.{alias.name}" in MODULES:
                        module_aliases.add(alias.asname or alias.name)
                    elif _private(alias.name) and target.startswith("tpx") and \
                            (target, alias.name) != ("tpx", "_C"):
                        found.append(f"{name}: from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        module_aliases.add(alias.asname)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in module_aliases and _private(node.attr):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert found == []


def test_no_python_file_over_600_lines():
    long = {str(path.relative_to(ROOT)): n for path, _ in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _tpx_modules():
    import pkgutil

    import tpx

    for info in pkgutil.walk_packages(tpx.__path__, "tpx."):
        if info.name.endswith("__main__"):
            continue
        if info.name == "tpx.nn.lora":  # needs peft
            try:
                import peft  # noqa: F401
            except ImportError:
                continue
        yield importlib.import_module(info.name)


def test_every_layer_and_collective_op_runs_under_the_guard():
    """Every tpx layer's forward and every op that communicates goes through the failure guard
    (docs/design.md, "A failure on one rank"), so a rank's error never leaves its peers
    waiting in a collective."""
    import inspect

    import torch

    import tpx.ops

    layers, missing = set(), []
    for module in _tpx_modules():
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and \
                    obj.__module__.startswith("tpx.") and "forward" in obj.__dict__:
                layers.add(obj)
                if not getattr(obj.__dict__["forward"], "_tpx_guarded", False):
                    missing.append(f"{obj.__module__}.{obj.__qualname__}.forward")
    assert len(layers) >= 10  # the walk found the layers
    ops = [name for name in tpx.ops.__all__
           if any("group" in p for p in inspect.signature(getattr(tpx.ops, name)).parameters)]
    assert {"all_gather_matmul", "vocab_parallel_embedding", "linear_2d"} <= set(ops)
    missing += [f"tpx.ops.{n}" for n in ops if not getattr(getattr(tpx.ops, n), "_tpx_guarded",
                                                              False)]
    assert missing == []


def _doc_names() -> List[str]:
    names = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        # `torch.ops.tpx.<op>` is the operator namespace, not a Python name.
        names.update(re.findall(r"(?<![\w.])tpx(?:\.[A-Za-z_]\w*)+", path.read_text()))
    return sorted(names)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_name_the_docs_use_imports():
    names = _doc_names()
    assert len(names) > 50 and "tpx.parallelize_module" in names  # the scan reads the docs
    assert not _resolves("tpx.no_such_name") and _resolves("tpx.checkpoint.save")
    missing = [n for n in names if not _resolves(n)]
    if importlib.util.find_spec("peft") is None:  # tpx.nn.lora needs peft (optional for users)
        missing = [n for n in missing if not n.startswith("tpx.nn.lora")]
    assert missing == []
