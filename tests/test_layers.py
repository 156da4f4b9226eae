"""The package's shape (issue 26, docs/design.md): every public name the README and docs mention imports; no import
inside a function of the product but the allowed ones; no product module over 600 lines or without a docstring;
``import ckpt_tools.cli`` does not import torch; the import contracts (lint-imports) and ruff hold."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 600
HEAVY = {"megatron", "vllm", "verl", "transformers"}  # optional heavy dependencies: imported where used
# (module, imported module) -> why it is imported inside a function: the documented start-up costs (docs/design.md)
DOCUMENTED = {
    ("ckpt_tools.cli.entry", "ckpt_tools.cli.commands"): "the commands need torch: imported after _quiet_c10d",
    ("ckpt_tools.cli.entry", "numpy"): "imported with one OpenBLAS thread (_one_blas_thread), after --help",
    ("ckpt_tools.torchrun.ranks", "torch.distributed"): "the CLI imports torchrun.ranks before torch",
    ("ckpt_tools.torchrun.connect", "torch.distributed"): "the same: ranks imports it (the store's connection)",
    ("ckpt_tools.torchrun.group", "torch.distributed"): "the same: ranks imports it (Group's PrefixStore)",
    ("ckpt_tools.formats.torch_dist", "torch.distributed.checkpoint"): "~0.6 s (DTensor, sympy); only where the stand-ins do not apply",
    ("ckpt_tools.formats.torch_dist", "torch.distributed.checkpoint.filesystem"): "the same package",
    ("ckpt_tools.formats.torch_dist_reader", "torch._subclasses.fake_tensor"): "torch 2.6 only: ~1.1 s on first use",
    ("ckpt_tools.cli.commands", "ckpt_tools.sync"): "torch.distributed: only plan --sync needs it (core/lazy.py)",
    ("ckpt_tools.cli.commands", "ckpt_tools.sync.cost"): "the same package",
}
NOT_PRODUCT = ("ckpt_tools.testing", "ckpt_tools._mcore_cpu")  # test support: outside these rules


def _modules():
    """(dotted name, path) of every module of ckpt_tools and converters."""
    out = []
    for pkg in ("ckpt_tools", "converters"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for fn in sorted(files):
                if fn.endswith(".py"):
                    p = os.path.join(dirpath, fn)
                    name = os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
                    out.append((name[:-9] if name.endswith(".__init__") else name, p))
    return out


def _product():
    return [(m, p) for m, p in _modules() if not any(m == x or m.startswith(x + ".") for x in NOT_PRODUCT)]


def _resolve(module: str, path: str, node) -> list[str]:
    """The modules an import statement names (``from . import x``: the package, x may be a module or a name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".")
    if node.level:
        base = base[: len(base) - node.level + (1 if path.endswith("__init__.py") else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    return [target]


def _local_imports(module: str, path: str):
    """(line, imported module) of every import statement inside a function of ``path``."""
    tree = ast.parse(open(path).read(), path)
    found = []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((child.lineno, t) for t in _resolve(module, path, child))
            visit(child, deeper)

    visit(tree, False)
    return found


def test_no_import_inside_a_function_but_the_allowed_ones():
    bad, used = [], set()
    for module, path in _product():
        for line, target in _local_imports(module, path):
            if target.split(".")[0] in HEAVY:
                continue
            if (module, target) in DOCUMENTED:
                used.add((module, target))
                continue
            bad.append(f"{os.path.relpath(path, ROOT)}:{line}: import of {target} inside a function")
    assert not bad, "\n".join(bad)
    assert used == set(DOCUMENTED), f"documented exceptions no longer used: {sorted(set(DOCUMENTED) - used)}"


def _underscore_imports(module: str, path: str):
    """(line, imported module, name) of every import of another module's underscore name (``from .x import _y``);
    a submodule whose name starts with an underscore (``from .. import _mcore_cpu``) is a module, not a name."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve(module, path, node)[0]
        if not target.startswith("ckpt_tools"):
            continue
        for a in node.names:
            sub = os.path.join(ROOT, *target.split("."), a.name)
            if a.name.startswith("_") and not a.name.startswith("__") and not (
                    os.path.isfile(sub + ".py") or os.path.isdir(sub)):
                found.append((node.lineno, target, a.name))
    return found


def test_no_underscore_name_crosses_a_module():
    """What one module uses of another is named without an underscore (issue 46: an internal API that is used is
    named; docs/design.md)."""
    bad = []
    for module, path in _modules():
        for line, target, name in _underscore_imports(module, path):
            bad.append(f"{os.path.relpath(path, ROOT)}:{line}: imports {name} from {target}")
    assert not bad, "\n".join(bad)


def test_the_allowed_ones_say_why_where_they_are():
    """Each documented function-local import carries a comment at its line or in the module that names the reason."""
    for module, target in DOCUMENTED:
        path = os.path.join(ROOT, *module.split(".")) + ".py"
        src = open(path).read()
        lines = src.splitlines()
        for line, t in _local_imports(module, path):
            if t == target:
                near = "\n".join(lines[max(0, line - 3):line])
                assert "lazy" in near or "documented start-up cost" in src, (module, target, line)


def test_modules_are_small_and_say_their_job():
    for module, path in _product() + [(m, p) for m, p in _modules() if m.startswith(NOT_PRODUCT)]:
        src = open(path).read()
        n = src.count("\n")
        if not any(module == x or module.startswith(x + ".") for x in NOT_PRODUCT):
            assert n <= MAX_LINES, f"{module}: {n} lines (at most {MAX_LINES})"
        doc = ast.get_docstring(ast.parse(src))
        assert doc and doc.strip(), f"{module}: no docstring saying its job"


def test_the_cli_imports_no_torch():
    """What the function-local imports of cli.entry and torchrun.ranks are for (docs/design.md)."""
    code = "import sys, ckpt_tools.cli; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def _named_in_docs():
    """Every dotted ckpt_tools name and every ckpt_tools/ or converters/ path the README and docs/ mention."""
    names, paths = set(), set()
    for fn in ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                      if f.endswith(".md")):
        text = open(os.path.join(ROOT, fn)).read()
        names |= set(re.findall(r"\bckpt_tools(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?", text))
        paths |= set(re.findall(r"\b(?:ckpt_tools|converters)/[\w/]*\w(?:\.py)?", text))
    names -= {"ckpt_tools.manifest.json", "ckpt_tools.json", "ckpt_tools.manifest", "ckpt_tools.manifest.json"}
    return sorted(names), sorted(paths)


def _resolves(dotted: str) -> bool:
    """``a.b.c`` (or ``a.b:c``): the longest prefix that is a module, the rest attributes of it. A module is found
    without importing it when nothing follows (the verl hook imports verl and patches it when imported)."""
    dotted = dotted.replace(":", ".")
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        mod = ".".join(parts[:k])
        try:
            spec = importlib.util.find_spec(mod)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        if k == len(parts):
            return True
        obj = importlib.import_module(mod)
        for a in parts[k:]:
            obj = getattr(obj, a)
        return True
    return False


def test_every_name_the_docs_mention_imports():
    names, paths = _named_in_docs()
    assert "ckpt_tools.sync.sync_weights" in names and "ckpt_tools.integrations.verl" in names
    missing = [n for n in names if not _resolves(n)]
    assert not missing, missing
    missing = [p for p in paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, missing


def test_public_import_paths():
    """The import paths users and project briefs name, kept across issue 26's moves."""
    from ckpt_tools.cli import EPILOG, build_parser, main  # noqa: F401 - the console script: ckpt_tools.cli:main
    from ckpt_tools.convert import hf2mcore, mcore2hf, mcore2mcore, reshard  # noqa: F401
    from ckpt_tools.integrations.verl_config import devices_per_node, rollout_parallel  # noqa: F401
    from ckpt_tools.integrations.vllm_plugin import register
    from ckpt_tools.layout import MegatronLayout, MegatronParallel, VllmLayout, VllmParallel  # noqa: F401
    from ckpt_tools.layout.model_config import config_from_dict, load_config  # noqa: F401
    from ckpt_tools.sync import Piece, SyncError, SyncSchedule, control_group_for, local_chunks, sync_weights  # noqa: F401
    from ckpt_tools.sync.cost import delta_figures, gather_all_figures, plan_sync  # noqa: F401
    from ckpt_tools.sync.digest import digest  # noqa: F401
    from ckpt_tools.testing import FakeActor, LayoutReceiver, free_port, hf_files, hf_tensor, spawn_ranks  # noqa: F401
    from ckpt_tools.testing.baselines import gather_all_figures as named_there
    from ckpt_tools.testing.baselines import sync_weights_gather_all  # noqa: F401
    from ckpt_tools.testing.synth import TINY, TINY_VLLM, make_synthetic_hf, make_tiny_hf, twin_config  # noqa: F401

    assert callable(register) and named_there is gather_all_figures
    for mod in ("ckpt_tools._mcore_cpu", "ckpt_tools.testing.megatron", "ckpt_tools.testing.vllm",
                "ckpt_tools.integrations.verl"):
        assert importlib.util.find_spec(mod) is not None, mod
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'ckpt-tools = "ckpt_tools.cli:main"' in pyproject
    assert '"ckpt_tools.integrations.vllm_plugin:register"' in pyproject


def test_python_m_cli():
    r = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout.startswith("usage: ckpt-tools"), r.stdout + r.stderr


@pytest.mark.parametrize("tool,argv", [("lint-imports", []), ("ruff", ["check", "."])])
def test_lint(tool, argv):
    """What .ci/run's main lane runs before the tests (where the tool is installed: the test extra has both)."""
    exe = shutil.which(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed")
    r = subprocess.run([exe, *argv], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_dtype_names_are_torchs():
    """core/lazy.py keeps metadata dtypes by name: every name is torch's, with torch's element size, and every
    safetensors dtype the reader accepts maps to one."""
    import torch

    from ckpt_tools.core.lazy import ITEMSIZE, dtype_name, torch_dtype
    from ckpt_tools.formats.hf import _DT

    for name, size in ITEMSIZE.items():
        assert torch_dtype(name) is getattr(torch, name) and torch_dtype(name).itemsize == size, name
        assert dtype_name(torch_dtype(name)) == name
    assert set(_DT.values()) <= set(ITEMSIZE)


GRAPH_DIRS = ("ckpt_tools", "converters", "scripts", "tests")  # tests/ and scripts/: their files import by bare name


def import_graph():
    """(modules, edges) of the repository's Python files in :data:`GRAPH_DIRS`: every ``import`` / ``from``
    statement (at module level or in a function) naming a file of the repository is an edge to that file's module
    (``from pkg import name``: pkg.name where that is a module, else pkg; a bare name in scripts/ or tests/: the
    file of that name beside the importer, as their ``sys.path`` has it)."""
    files = {}  # module -> path
    for top in GRAPH_DIRS:
        for dirpath, dirs, fns in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "fixtures"))
            for fn in sorted(fns):
                if fn.endswith(".py"):
                    p = os.path.join(dirpath, fn)
                    name = os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
                    files[name[:-9] if name.endswith(".__init__") else name] = p

    def find(dotted: str, here: str):
        parts = dotted.split(".")
        local = os.path.relpath(os.path.dirname(files[here]), ROOT).replace(os.sep, ".")
        for base in ([local] if local in ("scripts", "tests") else []) + [""]:
            for k in range(len(parts), 0, -1):
                cand = ".".join(([base] if base else []) + parts[:k])
                if cand in files:
                    return cand
        return None

    edges = set()
    for module, path in files.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.module == "__future__":
                    continue
                pkg = _resolve(module, path, node)[0]
                targets = [f"{pkg}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                hit = find(t, module)
                if hit is not None and hit != module:
                    edges.add((module, hit))
    return sorted(files), sorted(edges)


def import_cycles(modules, edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative): each holds a cycle."""
    succ = {m: [] for m in modules}
    for a, b in edges:
        succ[a].append(b)
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = n
                n += 1
                stack.append(v)
                on.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


def test_no_import_cycle_anywhere():
    """No circle of imports in ckpt_tools/, converters/, scripts/ or tests/ (issue 56), inside a package included;
    the figures printed (pytest -s): modules, import edges, cycles."""
    modules, edges = import_graph()
    cycles = import_cycles(modules, edges)
    print(f"import graph: {len(modules)} modules, {len(edges)} import edges, {len(cycles)} cycles")
    assert len(modules) > 150 and len(edges) > 300  # the walk sees the repository, not a corner of it
    assert ("scripts.bench_optim", "ckpt_tools.testing.training") in edges  # a function-level import counts
    assert not cycles, cycles
