"""Tools that ship with the package (`rollout.options.tools: [gcore_rl.agents.builtin_tools:calculator]`)."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_DIGITS = 200


def mul(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(int(a) * int(b))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % and parentheses.

    Args:
        expression: the expression, for example "(12 + 7) * 3"
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic syntax tree (ValueError for anything else: names, calls, powers)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
