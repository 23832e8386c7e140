"""The suite's own rules, read from its source with ``ast``:

* every wait is on a condition: a ``sleep`` of a constant 1 s or more (``time.sleep``, ``asyncio.sleep``,
  any ``….sleep(N)``) carries a comment on its line or the line above saying why no condition can serve;
* helpers come from the support surface (``tests/support.py`` and package-local support modules): nothing
  imports a private name (a leading underscore), anything from a test module (``test_*.py``), or anything
  from a ``conftest.py`` (pytest loads those for their fixtures; a helper there is reachable only by a path).

Each rule is shown catching a planted case, then holding on the suite itself.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LONGEST_UNCOMMENTED_SLEEP_S = 1.0  # a shorter sleep is a poll interval, not a wait

# Modules another change owns and is rewriting (issue #29: the serving tests move onto their own fixtures);
# they import helpers from test modules until then. Nothing new joins this list.


def _in_line_order(tree: ast.AST) -> list[ast.AST]:
    return sorted(
        ast.walk(tree), key=lambda node: (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
    )


def _comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}


def _constant_seconds(call: ast.Call) -> float | None:
    """The call's first argument when it is a number written in the source (``-`` included)."""
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub):
        return None  # a negative sleep returns at once
    if (
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, int | float)
        and not isinstance(arg.value, bool)
    ):
        return float(arg.value)
    return None


def uncommented_sleeps(path: Path, source: str) -> list[str]:
    """``path:line: sleep(N)`` for each sleep of a constant >= 1 s with no comment on its line or above."""
    comments = _comment_lines(source)
    found = []
    for node in _in_line_order(ast.parse(source, filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        seconds = _constant_seconds(node)
        if name != "sleep" or seconds is None or seconds < LONGEST_UNCOMMENTED_SLEEP_S:
            continue
        if not comments & {node.lineno - 1, node.lineno, node.end_lineno or node.lineno}:
            found.append(
                f"{path}:{node.lineno}: sleep({seconds:g}) without a reason a condition cannot serve"
            )
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def _is_conftest(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1] == "conftest"


def forbidden_imports(path: Path, source: str) -> list[str]:
    """``path:line: ...`` for each import of a private name, or of anything from a test module."""
    found = []
    for node in _in_line_order(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_test_module(alias.name) and alias.name.startswith("tests."):
                    found.append(f"{path}:{node.lineno}: imports the test module {alias.name}")
                if any(_is_private(part) for part in alias.name.split(".")):
                    found.append(f"{path}:{node.lineno}: imports the private module {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module == "__future__":
                continue
            if _is_test_module(module):
                found.append(f"{path}:{node.lineno}: imports from the test module {module}")
            if _is_conftest(module):
                found.append(f"{path}:{node.lineno}: imports from {module}: helpers live in support modules")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{path}:{node.lineno}: imports the private name {alias.name} from {module}")
                elif _is_test_module(alias.name) and (node.level or module.startswith("tests")):
                    found.append(f"{path}:{node.lineno}: imports the test module {module}.{alias.name}")
    return found


def _suite() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(TESTS.rglob("*.py")) if "__pycache__" not in p.parts]


# ---------------------------------------------------------------- planted cases


PLANTED_SLEEPS = """
import asyncio, time
from time import sleep

async def waits(clock) -> None:
    await asyncio.sleep(3)
    time.sleep(1)
    sleep(2.5)
    await clock.sleep(10)
    # Envoy's drain timer is wall-clock time: nothing to observe.
    await asyncio.sleep(5)
    time.sleep(4)  # the lease must expire on the standby's own clock
    await asyncio.sleep(0.5)
    time.sleep(delay)
"""


def test_the_sleep_rule_catches_uncommented_sleeps_of_a_second_or_more(tmp_path: Path) -> None:
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED_SLEEPS)
    found = uncommented_sleeps(planted, PLANTED_SLEEPS)
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in found] == ["6", "7", "8", "9"], found
    assert "sleep(3)" in found[0] and "sleep(2.5)" in found[2]


PLANTED_IMPORTS = """
from __future__ import annotations
import tests.sim.test_serving_streaming
from tests.recovery.test_hardware_path import TIMINGS
from tests.support import _until_routed, POOL
from worker.devstack.rig import _declared
from .test_neighbour import helper
from tests.recovery import test_second_day
from tests.support import FAST
from worker.devstack import rig
from tests.webhook.conftest import serve_webhook
"""


def test_the_import_rule_catches_private_names_and_test_module_helpers(tmp_path: Path) -> None:
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED_IMPORTS)
    found = forbidden_imports(planted, PLANTED_IMPORTS)
    lines = [int(line.split(": ", 1)[0].rsplit(":", 1)[1]) for line in found]
    assert lines == [3, 4, 5, 6, 7, 8, 11], found
    assert "_until_routed" in found[2] and "POOL" not in found[2]


# ---------------------------------------------------------------- the suite itself


def test_every_sleep_of_a_second_or_more_in_the_suite_says_why() -> None:
    found = [line for path, source in _suite() for line in uncommented_sleeps(path, source)]
    assert found == [], "\n".join(found)


def test_the_suite_imports_helpers_only_from_the_support_surface() -> None:
    found = [line for path, source in _suite() for line in forbidden_imports(path, source)]
    assert found == [], "\n".join(found)
