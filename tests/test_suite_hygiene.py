"""The suite itself: every test checks something.

A test function counts as checking something when its body (nested code included) contains

- an `assert` statement;
- `pytest.raises`, `pytest.warns` or `pytest.deprecated_call` (as a context manager or a call), or
  `pytest.fail`;
- a call of a function or method whose name starts with `assert` (`assert_user_error`,
  `torch.testing.assert_close`, `mock.assert_called_once`), `check_` or `expect_`;
- or a call of a function defined at the top level of the same test file that itself counts by
  these rules (helpers such as `_run` that assert on what they produce), followed through any
  number of such helpers.

Assertions hidden elsewhere (in fixtures, in helpers imported from other modules with other
names) do not count: name such a helper `assert_…`/`check_…`/`expect_…`, or assert in the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKING_PREFIXES = ("assert", "check_", "expect_")
PYTEST_CHECKS = {"raises", "warns", "deprecated_call", "fail"}


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _is_pytest_check(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr in PYTEST_CHECKS
            and isinstance(func.value, ast.Name) and func.value.id == "pytest")


def _checks(node: ast.AST, checking_helpers: set[str]) -> bool:
    """Whether `node` contains an assertion by the rules of the module docstring."""
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            return True
        if isinstance(child, ast.Call):
            name = _called_name(child)
            if _is_pytest_check(child) or (name is not None and (name.startswith(CHECKING_PREFIXES)
                                                                 or name in checking_helpers)):
                return True
    return False


def _tests_without_assertions(path: Path, root: Path) -> list[str]:
    """`file:line:name` (file relative to `root`) of each test function in `path` that checks nothing."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    helpers = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    checking: set[str] = set()
    changed = True
    while changed:  # a helper checks when it asserts or calls a helper that does
        changed = False
        for name, node in helpers.items():
            if name not in checking and _checks(node, checking):
                checking.add(name)
                changed = True
    tests = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and node.name.startswith("test_")]
    return [f"{path.relative_to(root)}:{node.lineno}:{node.name}" for node in tests
            if not _checks(node, checking)]


def test_every_test_function_asserts_or_expects_an_exception():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 10  # the walk found the suite
    flagged = [entry for path in files for entry in _tests_without_assertions(path, TESTS.parent)]
    assert not flagged, "test functions that check nothing (see the rules in tests/test_suite_hygiene.py):\n" + \
        "\n".join(flagged)


def test_the_rules_tell_a_checking_test_from_an_empty_one(tmp_path):
    source = '''
import pytest

def _helper(x):
    assert x

def _indirect(x):
    _helper(x)

def test_asserts():
    assert 1

def test_raises():
    with pytest.raises(ValueError):
        int("x")

def test_named_helper(proc):
    assert_user_error(proc)

def test_local_helper():
    _indirect(1)

def test_runs_only():
    print("no check")

class TestGrouped:
    def test_method_without_check(self):
        pass
'''
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    flagged = [entry.rsplit(":", 1)[1] for entry in _tests_without_assertions(path, tmp_path)]
    assert flagged == ["test_runs_only", "test_method_without_check"]


def test_the_forkserver_preloads_modules_that_exist():
    """A renamed or deleted module left in `cli_helpers.PRELOAD` is skipped without a word by the forkserver, and
    every CLI test that needed it pays its import again."""
    import importlib.util

    from cli_helpers import PRELOAD

    missing = [name for name in PRELOAD if name.startswith("gcore_rl") and importlib.util.find_spec(name) is None]
    assert not missing, f"cli_helpers.PRELOAD names modules that do not exist: {missing}"
