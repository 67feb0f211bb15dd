"""The ``calculator`` tool: arithmetic expressions evaluated from their syntax tree, never with ``eval``."""

from __future__ import annotations

import ast
import math

#: Binary operators the calculator accepts, by AST node type.
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


def evaluate(expression: str, *, max_exponent: int = 64, max_length: int = 200, max_digits: int = 100) -> str:
    """Value of an arithmetic expression over numbers with ``+ - * / // % **``, unary minus and parentheses.

    The expression is parsed with :mod:`ast` and only those nodes are evaluated; names, calls,
    attributes and everything else are refused, so no code can run. Exponents are bounded (``2 **
    10**9`` would take the process down) and so are intermediate results' digits.

    Args:
        expression: e.g. ``"(1234 * 5678) - 90"``; ``^`` is not power (it is refused: XOR in Python).
        max_exponent: largest ``|exponent|`` allowed in ``**``.
        max_length: longest expression accepted, in characters.
        max_digits: largest number of digits of any intermediate integer.

    Returns:
        The value as text: an integer without decimals (``"7006652"``), a float via ``repr``
        (``"0.5"``); floats that are whole numbers print as integers (``6 / 3`` -> ``"2"``).

    Raises:
        ValueError: the expression is too long, does not parse, uses anything but the allowed
            operators and numbers, divides by zero, or exceeds a limit (the message says which).
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > max_length:
        raise ValueError(f"expression is {len(expression)} characters long; the limit is {max_length}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None

    def check(value):
        if isinstance(value, int) and abs(value) >= 10 ** max_digits:
            raise ValueError(f"a result has more than {max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("a result is not a finite number")
        return value

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exp = ev(node.left), ev(node.right)
            if abs(exp) > max_exponent:
                raise ValueError(f"exponent {exp} is larger than {max_exponent} in absolute value")
            if base == 0 and exp < 0:
                raise ValueError("division by zero")
            return check(base ** exp)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise ValueError("division by zero")
            return check(_BINOPS[type(node.op)](a, b))
        what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise ValueError(f"{what} is not allowed: only numbers, + - * / // % **, unary minus and parentheses")

    value = ev(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def calculator(expression: str, max_exponent: int = 64) -> str:
    """The tool's callable: :func:`evaluate` with the tool config's ``max_exponent``."""
    return evaluate(expression, max_exponent=max_exponent)
