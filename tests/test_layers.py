"""Dependencies point one way (DESIGN.md §1): no package imports a floor above its own.

The checker reads every package's sources with ``ast`` — module-level imports, imports inside
functions and ``TYPE_CHECKING`` blocks, relative imports and ``importlib.import_module("...")``
with a literal name — so an upward import cannot hide in a function body. ``workflows`` may
reach ``activities`` only for references, i.e. inside ``workflow.unsafe.imports_passed_through()``,
where the sandbox passes the module through instead of running its I/O imports.
"""

from __future__ import annotations

import ast
import gc
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Which of our packages each package may import (besides itself). None: the top floor, anything.
MAY_IMPORT: dict[str, frozenset[str] | None] = {
    "fleet": frozenset(),
    "kube": frozenset({"fleet"}),
    "ledger": frozenset({"fleet"}),
    "gateway": frozenset({"ledger", "kube", "fleet"}),
    "activities": frozenset({"gateway", "ledger", "kube", "fleet"}),
    "workflows": frozenset({"activities", "fleet"}),
    "sim": frozenset({"fleet"}),
    "worker": None,
    "bench": None,  # benchmarks drive the whole product, like the worker's devstack does
}
# Imports a package may make only as references inside ``imports_passed_through()``.
REFERENCES_ONLY: dict[str, frozenset[str]] = {"workflows": frozenset({"activities"})}
# Not part of the product: never imported by it, free to import anything.
NOT_A_FLOOR = frozenset({"tests"})


@dataclass(frozen=True)
class Upward:
    path: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported} ({self.why})"


def packages(root: Path) -> list[str]:
    """Top-level packages under ``root``: directories with an ``__init__.py``."""
    return sorted(p.parent.name for p in root.glob("*/__init__.py") if not p.parent.name.startswith("."))


def _module_package(root: Path, path: Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]  # a module's package; for __init__.py, the package itself


def _is_passthrough(node: ast.With) -> bool:
    """``with workflow.unsafe.imports_passed_through():`` (any alias of ``workflow``)."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            if call.func.attr == "imports_passed_through":
                return True
    return False


def _imports(tree: ast.AST, package: list[str]) -> Iterator[tuple[int, str, bool]]:
    """(line, absolute module name, inside imports_passed_through) for every import in ``tree``."""

    def walk(node: ast.AST, passthrough: bool) -> Iterator[tuple[int, str, bool]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, passthrough
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                anchor = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base:
                yield node.lineno, base, passthrough
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, passthrough
        inside = passthrough or (isinstance(node, ast.With) and _is_passthrough(node))
        for child in ast.iter_child_nodes(node):
            yield from walk(child, inside)

    yield from walk(tree, False)


def _parse(source: str, filename: str) -> ast.Module:
    """``ast.parse``, robust to a CPython 3.11 fault: in a test process where earlier tests left
    threads running, building the AST once raised "SystemError: AST constructor recursion depth
    mismatch" (CI, 2026-12-07, parsing gateway/server.py; the AST module's recursion count is not
    kept per thread in 3.11, python/cpython#106905). The source is fine; the parse is made with the
    garbage collector held off (no finalizer runs mid-build) and, on that one error, made again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            return ast.parse(source, filename=filename)
        except SystemError as err:
            if "recursion depth mismatch" not in str(err):
                raise
            return ast.parse(source, filename=filename)
    finally:
        if enabled:
            gc.enable()


def upward_imports(root: Path) -> list[Upward]:
    """Every import under ``root`` that points to a floor its package may not import."""
    ours = set(packages(root))
    found: list[Upward] = []
    for package in sorted(ours - NOT_A_FLOOR):
        allowed = MAY_IMPORT.get(package, frozenset())
        references = REFERENCES_ONLY.get(package, frozenset())
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = _parse(path.read_text(), rel)
            for line, module, passthrough in _imports(tree, _module_package(root, path)):
                top = module.split(".")[0]
                if top not in ours or top == package or allowed is None:
                    continue
                if top in references:
                    if not passthrough:
                        found.append(
                            Upward(
                                rel,
                                line,
                                module,
                                f"{package} may import {top} only as references, "
                                "inside workflow.unsafe.imports_passed_through()",
                            )
                        )
                    continue
                if top not in allowed:
                    floors = ", ".join(sorted(allowed | references)) or "nothing of ours"
                    found.append(Upward(rel, line, module, f"{package} may import {floors}"))
    return found


def test_the_product_imports_no_floor_above_its_own() -> None:
    found = upward_imports(REPO)
    assert not found, "Upward imports (DESIGN.md §1):\n" + "\n".join(map(str, found))


def test_every_package_has_a_floor() -> None:
    """A new top-level package must be placed in MAY_IMPORT (and in DESIGN.md §1) before it ships."""
    unplaced = set(packages(REPO)) - set(MAY_IMPORT) - NOT_A_FLOOR
    assert not unplaced, f"packages with no floor in MAY_IMPORT: {sorted(unplaced)}"
    assert {"fleet", "kube", "ledger", "gateway", "activities", "workflows", "sim", "worker"} <= set(
        packages(REPO)
    )


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_planted_upward_import_is_caught_wherever_it_hides(tmp_path: Path) -> None:
    packages_ = ["fleet", "kube", "ledger", "gateway", "activities", "workflows", "sim", "worker", "tests"]
    _plant(tmp_path, {f"{p}/__init__.py": "" for p in packages_})
    _plant(
        tmp_path,
        {
            # Allowed: each points down (or is on the top floor, or is a test).
            "kube/client.py": "from fleet.vocabulary import MODEL_LABEL\n",
            "gateway/ok.py": "import kube.informer\nfrom ledger import store\nfrom gateway.store import S\n",
            "activities/ok.py": "from gateway.store import GatewayStore\nfrom kube.client import kube_apis\n",
            "workflows/ok.py": """\
                from temporalio import workflow

                from fleet.incident import LossReport

                with workflow.unsafe.imports_passed_through():
                    from activities.act import ActActivities
                """,
            "worker/ok.py": "from gateway.run import run\nfrom workflows.ok import X\n",
            "tests/ok.py": "from worker.ok import run\n",
            # Upward, each hidden differently.
            "gateway/world.py": """\
                def watch():
                    from worker.fastpath.informer import Informer
                    return Informer
                """,
            "gateway/run.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    import activities.kube
                """,
            "kube/deep/lease.py": "from ...gateway import store\n",
            "fleet/policy.py": "import importlib\nledger = importlib.import_module('ledger.store')\n",
            "sim/app.py": "from kube.client import KubeApis\n",
            "workflows/bad.py": "from activities.act import perform_effect\n",
        },
    )

    found = {(u.path, u.line, u.imported) for u in upward_imports(tmp_path)}

    assert found == {
        ("gateway/world.py", 2, "worker.fastpath.informer"),
        ("gateway/run.py", 4, "activities.kube"),
        ("kube/deep/lease.py", 1, "gateway"),
        ("fleet/policy.py", 2, "ledger.store"),
        ("sim/app.py", 1, "kube.client"),
        ("workflows/bad.py", 1, "activities.act"),
    }
    why = {u.path: u.why for u in upward_imports(tmp_path)}
    assert why["kube/deep/lease.py"] == "kube may import fleet"
    assert why["fleet/policy.py"] == "fleet may import nothing of ours"
    assert "imports_passed_through" in why["workflows/bad.py"]
