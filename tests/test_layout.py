"""The three floors, checked on the source: the library knows no service and no grpc, serving code never
imports torch, services never import each other, the kernels import nothing above them, configuration is a
leaf, no modules import each other in a loop, the gateway imports no torch, and no hand-written module is
over 700 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("draft_service", "target_service", "gateway")
GENERATED = ROOT / "specdec" / "v1"


def _modules() -> list[Path]:
    paths = []
    for top in ("specdec", "kernels", *SERVICES):
        paths += [p for p in (ROOT / top).rglob("*.py") if GENERATED not in p.parents]
    return sorted(paths)


def _imports(path: Path) -> set[str]:
    """Every module the file imports (at any depth: lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _floor(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] in SERVICES:
        return rel[0]
    if rel[0] == "kernels":
        return "kernels"
    if len(rel) > 2 and rel[1] in ("serving", "entrypoints"):
        return rel[1]
    return "library"


def _uses(imports: set[str], prefix: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for name in imports)


MODULES = _modules()


def test_the_walk_sees_every_floor():
    floors = {_floor(p) for p in MODULES}
    assert {"library", "serving", "entrypoints", "kernels", *SERVICES} <= floors


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_floors(path: Path):
    imports, floor = _imports(path), _floor(path)
    assert not (_uses(imports, "torch") and _uses(imports, "grpc")), "imports both torch and grpc"
    others = [s for s in SERVICES if s != floor]
    if floor != "entrypoints":
        assert not [s for s in others if _uses(imports, s)], f"{floor} imports another service"
        assert not _uses(imports, "specdec.entrypoints"), "only entry points import entry points"
    if floor in ("library", "kernels"):
        for banned in ("grpc", "grpc_health", "grpc_reflection", "specdec.v1", "specdec.serving", "fastapi"):
            assert not _uses(imports, banned), f"the {floor} imports {banned}"
    if floor == "serving":
        assert not _uses(imports, "torch"), "serving code reaches torch through the library, never directly"
    if floor == "kernels":
        assert not _uses(imports, "specdec"), "the kernels import nothing above them (the library picks them)"
    if path == ROOT / "specdec" / "config.py":  # configuration is a leaf: what it checks, it defines
        assert {m for m in imports if m.startswith("specdec")} <= {
            "specdec.errors", "specdec.errors.ConfigError", "specdec.proposal",
            "specdec.proposal.check_num_speculative_tokens", "specdec.proposal.MAX_NUM_SPECULATIVE_TOKENS"}, imports


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_readable(path: Path):
    lines = path.read_text().count("\n")
    assert lines <= 700, f"{lines} lines: split it"


def test_transformers_does_not_take_our_kernels_package_for_hugging_faces():
    """kernels/ shares its import name with Hugging Face's `kernels` distribution: with that installed,
    transformers imports our package as the hub's and fails loading any model (pyproject and install.sh)."""
    from transformers.utils import is_kernels_available

    assert not is_kernels_available(), "uninstall Hugging Face's `kernels` (scripts/install.sh does)"


# What the gateway process imports when it starts. It runs no model: torch (and what imports it: xgrammar, transformers'
# model classes) stays out, reached directly or through any module in between. A structured-output request compiles
# its grammar with xgrammar, which imports torch then (``specdec.structured``).
GATEWAY_ENTRY_POINTS = ("gateway.__main__", "gateway.server", "gateway.openai.api_server", "specdec.model_files")
NOT_IN_THE_GATEWAY = ("torch", "triton", "xgrammar")


def _module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_at_start(path: Path) -> set[str]:
    """The modules a file imports when it is imported: module-level statements, not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def import_chains(entry_points: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    """Each way a banned module is imported at start-up from the entry points: 'a -> b -> torch'."""
    chains, seen, queue = [], set(), [(name, (name,)) for name in entry_points]
    while queue:
        name, chain = queue.pop(0)
        path = _module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # packages run first
        for imported in [*parents, *sorted(_imported_at_start(path))]:
            if imported.split(".")[0] in banned:
                chains.append(" -> ".join((*chain, imported)))
            elif imported not in seen:
                queue.append((imported, (*chain, imported)))
    return chains


def test_the_gateway_imports_no_torch():
    assert import_chains(GATEWAY_ENTRY_POINTS, NOT_IN_THE_GATEWAY) == []
    # the walk follows modules in between: the services' entry points do reach torch, through the library
    assert any(chain.endswith("-> torch") and chain.count("->") >= 2
               for chain in import_chains(("target_service.__main__",), ("torch",)))


def test_a_started_gateway_has_not_imported_torch(tmp_path):
    """The same in a real interpreter, with a real tokenizer loaded as the gateway loads it."""
    code = ("import sys\n"
            f"import {', '.join(GATEWAY_ENTRY_POINTS)}\n"
            "from specdec.model_files import load_tokenizer\n"
            "tokenizer = load_tokenizer('smollm2-135m')\n"
            "assert tokenizer('hello').input_ids, 'the tokenizer encodes'\n"
            f"print(sorted(m for m in {NOT_IN_THE_GATEWAY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def import_circles(paths: list[Path]) -> list[list[str]]:
    """The import circles among ``paths`` (each a list of modules that import each other in a loop), lazy and
    type-checking imports included; a package's ``__init__.py`` only hands names on and is left out."""
    modules = {_module_name(p): p for p in paths if p.name != "__init__.py"}
    graph = {name: sorted({imported for imported in _imports(path) if imported in modules and imported != name})
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return circles


def test_no_import_circles(monkeypatch):
    assert import_circles(MODULES) == []
    # the walk sees a circle where there is one (a module that imports its own importer)
    a, b = ROOT / "specdec" / "engine" / "kv_manager.py", ROOT / "specdec" / "engine" / "runner.py"
    assert "specdec.engine.kv_manager" in _imports(b) and "specdec.engine.runner" not in _imports(a)
    plain = _imports
    monkeypatch.setattr(sys.modules[__name__], "_imports",
                        lambda p: plain(p) | ({"specdec.engine.runner"} if p == a else set()))
    assert import_circles(MODULES) == [["specdec.engine.kv_manager", "specdec.engine.runner"]]
