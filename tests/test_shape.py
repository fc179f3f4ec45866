"""The package keeps its shape (docs/architecture.md, "Packages and what each may import").

Every module of fastgrpo (``fastgrpo/**/*.py``, and ``kernels/*.py`` as ``fastgrpo.kernels.*``) is parsed with
``ast``; its imports are read at any depth (module level, inside functions and ``TYPE_CHECKING`` blocks, relative
imports, and ``importlib.import_module`` of a literal name). The tests fail, naming the modules, on

- an import cycle between modules (inside one package too);
- an import against the allowed direction: a module imports only modules of a strictly lower rank (``RANKS``) or
  of its own package, and ``fastgrpo/__init__.py`` imports the kernels only;
- an underscore name imported from another module (``from m import _x``, ``import m._private``);
- a module over ``MAX_LINES`` lines (``config.py`` excepted: one documented tree of dataclasses);
- a file of the repository citing a design or style document that is not in it.

The checker's functions take a root folder, so the synthetic module sets below prove each check can fail.
"""

import ast
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fastgrpo"
MAX_LINES = 600
LONG_ALLOWED = {"fastgrpo.config"}

# A module's group is the first name under fastgrpo (fastgrpo.engine.loop -> engine; fastgrpo.plan -> plan); a
# module may import a group of a strictly lower rank, or its own group. Equal ranks never import each other.
RANKS = {
    "train": 10,
    "trainer": 9,
    "plan": 8,
    "shapes": 7.5,
    "eval": 8,
    "export_merged": 8,
    "rollouts": 8,
    "algorithms": 7,
    "environments": 6,
    "engine": 5,
    "rewards": 5,
    "data": 5,
    "checkpoint": 4.5,
    "models": 4,
    "metrics": 2,
    "precision": 2,
    "distributed": 1,
    "config": 0.5,
    "kernels": 0,
}
ROOT_MAY_IMPORT = {"kernels"}  # fastgrpo/__init__.py re-exports the losses, nothing else

# Documents outside the repository that no file may cite (spelled as patterns so this file does not cite them).
FOREIGN_DOCS = re.compile(r"\b(DESIGN|STYLE|METHOD)\.md\b")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", ".json", ".csv"}
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".benchmarks", ".hypothesis"}


@dataclass(frozen=True)
class Import:
    target: str  # the module the statement loads (fastgrpo.engine.cache), resolved from relative form
    name: str | None  # the name taken from it (from m import name), None for `import m`
    line: int


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    imports: list[Import] = field(default_factory=list)


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__) for fastgrpo/**/*.py and kernels/*.py."""
    found: dict[str, tuple[Path, bool]] = {}
    for base, prefix in ((root / PACKAGE, (PACKAGE,)), (root / "kernels", (PACKAGE, "kernels"))):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if any(part in SKIP_DIRS for part in rel):
                continue
            is_package = rel[-1] == "__init__"
            found[".".join(prefix + (rel[:-1] if is_package else rel))] = (path, is_package)
    return found


def _raw_imports(tree: ast.AST) -> Iterable[tuple[int, str, str | None, int]]:
    """(relative level, module, name or None, line) for every import in the tree, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield node.level, node.module or "", alias.name, node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "import_module" and isinstance(node.args[0].value, str) and len(node.args) == 1:
                yield 0, node.args[0].value, None, node.lineno


def collect(root: Path) -> dict[str, Module]:
    """Every module of the package under ``root``, with its imports of other modules of the package."""
    files = module_files(root)
    modules: dict[str, Module] = {}
    for name, (path, is_package) in files.items():
        text = path.read_text(encoding="utf-8")
        module = Module(name, path, is_package, text.count("\n") + (not text.endswith("\n") and bool(text)))
        here = name if is_package else name.rpartition(".")[0]
        for level, mod, alias, line in _raw_imports(ast.parse(text, filename=str(path))):
            if level:
                base = here.split(".")
                base = base[: len(base) - (level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            if mod != PACKAGE and not mod.startswith(PACKAGE + "."):
                continue
            if alias is not None and f"{mod}.{alias}" in files:  # from pkg import submodule
                module.imports.append(Import(f"{mod}.{alias}", None, line))
            else:
                module.imports.append(Import(mod, alias, line))
        modules[name] = module
    return modules


def group(name: str) -> str | None:
    """The rank-table group of a module name; None for the root package ``fastgrpo`` itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (an unknown target, a typo or a name that is no module,
    is reached through its nearest known parent)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, module in modules.items():
        for imp in module.imports:
            target = imp.target
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted."""
    graph = edges(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
    return sorted(found)


def direction_violations(modules: dict[str, Module]) -> list[str]:
    """``importer -> imported`` for each import of the package against the rank table."""
    bad = []
    for name, targets in sorted(edges(modules).items()):
        src = group(name)
        for target in sorted(targets):
            dst = group(target)
            if src is None:
                ok = dst in ROOT_MAY_IMPORT
            elif dst is None:
                ok = False  # the root package re-exports the losses for users; inside, import fastgrpo.kernels
            elif src == dst:
                ok = True
            elif src not in RANKS or dst not in RANKS:
                ok = False  # a group the table does not know: add it to the table (and docs/architecture.md)
            else:
                ok = RANKS[dst] < RANKS[src]
            if not ok:
                bad.append(f"{name} ({RANKS.get(src, src or 'root')}) -> {target} ({RANKS.get(dst, dst or 'root')})")
    return bad


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_imports(modules: dict[str, Module]) -> list[str]:
    """``importer:line imports name from module`` for each underscore module or name taken from another module."""
    bad = []
    for name, module in sorted(modules.items()):
        for imp in module.imports:
            parts = imp.target.split(".") + ([imp.name] if imp.name else [])
            hidden = [p for p in parts if _private(p)]
            if hidden and imp.target != name:
                bad.append(f"{name}:{imp.line} imports {'.'.join(parts)}")
    return bad


def long_modules(modules: dict[str, Module]) -> list[str]:
    return sorted(
        f"{name} ({m.lines} lines)" for name, m in modules.items() if m.lines > MAX_LINES and name not in LONG_ALLOWED
    )


def _skipped(folder: str) -> bool:
    """A folder that is no part of the sources: caches, environments, build outputs."""
    return folder in SKIP_DIRS or folder.startswith(".venv") or folder in {"build", "dist"} or folder.endswith(
        ".egg-info")


def repository_files(root: Path) -> list[Path]:
    """The repository's text files: git's tracked and untracked-but-not-ignored ones when ``root`` is a checkout,
    else every text file under ``root``."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.splitlines()
        paths = [root / p for p in listed]
    else:
        paths = [p for p in root.rglob("*") if not any(_skipped(part) for part in p.relative_to(root).parts[:-1])]
    return sorted(p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file())


def foreign_citations(root: Path) -> list[str]:
    bad = []
    for path in repository_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if FOREIGN_DOCS.search(line):
                bad.append(f"{path.relative_to(root)}:{number}")
    return bad


@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    return collect(ROOT)


def _listing(title: str, items: list) -> str:
    return title + ":\n  " + "\n  ".join(str(i) for i in items)


# ------------------------------------------------------------------------------------------------ the real package


def test_the_package_is_found(package):
    assert {"fastgrpo", "fastgrpo.config", "fastgrpo.kernels", "fastgrpo.engine", "fastgrpo.train"} <= set(package)
    assert sum(len(m.imports) for m in package.values()) > 100


def test_no_import_cycles(package):
    found = cycles(package)
    assert not found, _listing("import cycles (each line: the modules that import each other in a ring)", found)


def test_imports_run_one_way(package):
    bad = direction_violations(package)
    assert not bad, _listing("imports against the rank table (importer (rank) -> imported (rank))", bad)


def test_no_private_names_cross_modules(package):
    bad = private_imports(package)
    assert not bad, _listing("underscore names imported from another module", bad)


def test_no_module_over_the_line_limit(package):
    bad = long_modules(package)
    assert not bad, _listing(f"modules over {MAX_LINES} lines", bad)


def test_no_file_cites_documents_outside_the_repository():
    bad = foreign_citations(ROOT)
    assert not bad, _listing("files citing a design/style document that is not in the repository", bad)


def test_every_group_has_a_rank(package):
    unknown = sorted({group(n) for n in package} - set(RANKS) - {None})
    assert not unknown, f"groups missing from the rank table (RANKS, docs/architecture.md): {unknown}"


# ----------------------------------------------------------------------------- the checker, on synthetic packages


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return collect(tmp_path)


def test_checker_resolves_every_import_form(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "import importlib\ndef f():\n    return importlib.import_module('fastgrpo.kernels')\n",
        "fastgrpo/engine/__init__.py": "from .cache import Cache\n",
        "fastgrpo/engine/cache.py": "import fastgrpo.config\nfrom fastgrpo import kernels\n",
        "fastgrpo/engine/loop.py": "def f():\n    from . import cache\n    from ..models.loading import load\n",
        "fastgrpo/models/__init__.py": "",
        "fastgrpo/models/loading.py": "import torch\n",
        "fastgrpo/config.py": "",
        "kernels/__init__.py": "from .utils import x\n",
        "kernels/utils.py": "",
    })
    graph = edges(modules)
    assert graph["fastgrpo"] == {"fastgrpo.kernels"}
    assert graph["fastgrpo.engine"] == {"fastgrpo.engine.cache"}
    assert graph["fastgrpo.engine.cache"] == {"fastgrpo.config", "fastgrpo.kernels"}
    assert graph["fastgrpo.engine.loop"] == {"fastgrpo.engine.cache", "fastgrpo.models.loading"}
    assert graph["fastgrpo.kernels"] == {"fastgrpo.kernels.utils"}
    assert graph["fastgrpo.models.loading"] == set()  # outside imports are not edges
    assert not cycles(modules) and not direction_violations(modules) and not private_imports(modules)


def test_checker_finds_a_cycle(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "",
        "fastgrpo/engine/__init__.py": "",
        "fastgrpo/engine/cache.py": "from fastgrpo.engine.forward import f\n",
        "fastgrpo/engine/forward.py": "def f():\n    from .cache import c\n",  # function-local: counts
        "fastgrpo/engine/loop.py": "from .cache import c\n",
    })
    assert cycles(modules) == [["fastgrpo.engine.cache", "fastgrpo.engine.forward"]]
    assert not direction_violations(modules)  # one package: the direction allows it, the cycle test does not


def test_checker_finds_a_cycle_across_packages(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "",
        "fastgrpo/train.py": "from fastgrpo.plan import p\n",
        "fastgrpo/plan.py": "from fastgrpo.algorithms import distill\n",
        "fastgrpo/algorithms/__init__.py": "",
        "fastgrpo/algorithms/distill.py": "def teacher():\n    import fastgrpo.train\n",
    })
    assert cycles(modules) == [["fastgrpo.algorithms.distill", "fastgrpo.plan", "fastgrpo.train"]]
    assert direction_violations(modules) == ["fastgrpo.algorithms.distill (7) -> fastgrpo.train (10)"]


def test_checker_finds_upward_and_sideways_imports(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "from fastgrpo import config\n",  # the root may import the kernels only
        "fastgrpo/config.py": "",
        "fastgrpo/metrics.py": "from fastgrpo.precision import p\n",  # equal ranks
        "fastgrpo/precision.py": "",
        "fastgrpo/data/__init__.py": "from fastgrpo.environments.core import Env\n",  # upward
        "fastgrpo/rewards/__init__.py": "def f():\n    from fastgrpo.engine import GenerationEngine\n",  # sideways
        "fastgrpo/engine/__init__.py": "",
        "fastgrpo/environments/__init__.py": "",
        "fastgrpo/environments/core.py": "from fastgrpo import grpo_loss\n",  # the root, from inside
        "kernels/__init__.py": "from ..config import C\n",  # relative, upward out of the kernels
        "fastgrpo/newthing.py": "",
        "fastgrpo/trainer.py": "import fastgrpo.newthing\n",  # a group the table does not know
    })
    assert direction_violations(modules) == [
        "fastgrpo (root) -> fastgrpo.config (0.5)",
        "fastgrpo.data (5) -> fastgrpo.environments.core (6)",
        "fastgrpo.environments.core (6) -> fastgrpo (root)",
        "fastgrpo.kernels (0) -> fastgrpo.config (0.5)",
        "fastgrpo.metrics (2) -> fastgrpo.precision (2)",
        "fastgrpo.rewards (5) -> fastgrpo.engine (5)",
        "fastgrpo.trainer (9) -> fastgrpo.newthing (newthing)",
    ]


def test_checker_finds_private_imports(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "__version__ = '0'\n",
        "fastgrpo/algorithms/__init__.py": "",
        "fastgrpo/algorithms/grpo.py": "_call = 1\n__all__ = []\n",
        "fastgrpo/algorithms/sft.py": "def f():\n    from .grpo import _call, __all__\n",
        "fastgrpo/algorithms/dpo.py": "import fastgrpo.kernels._utils\nfrom fastgrpo import __version__\n",
        "kernels/__init__.py": "from . import _utils\n",
        "kernels/_utils.py": "",
    })
    assert private_imports(modules) == [
        "fastgrpo.algorithms.dpo:1 imports fastgrpo.kernels._utils",
        "fastgrpo.algorithms.sft:2 imports fastgrpo.algorithms.grpo._call",
        "fastgrpo.kernels:1 imports fastgrpo.kernels._utils",
    ]


def test_checker_finds_long_modules(tmp_path):
    modules = _tree(tmp_path, {
        "fastgrpo/__init__.py": "",
        "fastgrpo/config.py": "x = 1\n" * (MAX_LINES + 50),
        "fastgrpo/plan.py": "x = 1\n" * (MAX_LINES + 1),
        "fastgrpo/eval.py": "x = 1\n" * MAX_LINES,
    })
    assert long_modules(modules) == [f"fastgrpo.plan ({MAX_LINES + 1} lines)"]


def test_checker_finds_foreign_citations(tmp_path):
    cite = "DESIGN" + ".md"
    _tree(tmp_path, {
        "README.md": f"See `{cite}`.\n",
        "fastgrpo/__init__.py": '"""fine"""\n',
        "tests/test_x.py": "# " + "STYLE" + ".md: line length\n",
        "docs/architecture.md": "MY_DESIGN.md is another name\n",
    })
    assert foreign_citations(tmp_path) == ["README.md:1", "tests/test_x.py:1"]
