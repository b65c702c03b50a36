"""The three floors, checked on the source: the library knows no service and no grpc, serving code never
imports torch, services never import each other, the kernels import nothing above them, configuration is a
leaf, and no hand-written module is over 700 lines."""

from __future__ import annotations

import ast
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
