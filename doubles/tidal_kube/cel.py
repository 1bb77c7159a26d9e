"""A subset of CEL, for the ``x-kubernetes-validations`` rules of a CRD: a recursive-descent
parser that compiles an expression to a closure over an environment (``{"self": value}``). No
Python eval: the rule text comes from CRDs a client posts.

The subset: field access, ``has``, ``size``, ``string``/``int``/``double``, arithmetic,
comparisons, ``in``, ``&&``/``||``/``!``, ``?:``, list literals, the ``all``/``exists`` macros
and the string methods ``startsWith``, ``endsWith``, ``contains``, ``matches``. Anything else
(``oldSelf`` included) raises :class:`CelUnsupported` at compile time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any


class CelError(Exception):
    """A rule that fails at evaluation time, e.g. a missing field ("no such key")."""


class CelUnsupported(Exception):
    """A rule outside the subset; the emulator then skips it."""


Env = dict[str, Any]
Expr = Callable[[Env], Any]

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
    r"|(?P<op>&&|\|\||==|!=|<=|>=|[<>!+\-*/%().,\[\]?:])|(?P<id>[A-Za-z_][A-Za-z0-9_]*))"
)
_CACHE: dict[str, Expr] = {}


def compile_cel(text: str) -> Expr:
    """Compile a CEL expression of the subset; raises CelUnsupported outside it."""
    if text not in _CACHE:
        parser = _Parser(text)
        expr = parser.ternary()
        if parser.peek() is not None:
            raise CelUnsupported(f"unexpected {parser.peek()!r} in {text!r}")
        _CACHE[text] = expr
    return _CACHE[text]


def _tokens(text: str) -> Iterator[tuple[str, str]]:
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise CelUnsupported(f"cannot read {text[pos:]!r}")
        pos = match.end()
        kind = match.lastgroup
        assert kind is not None
        yield kind, match.group(kind)


class _Parser:
    def __init__(self, text: str) -> None:
        self.items = list(_tokens(text))
        self.pos = 0

    def peek(self) -> str | None:
        return self.items[self.pos][1] if self.pos < len(self.items) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.pos >= len(self.items):
            raise CelUnsupported("unexpected end")
        item = self.items[self.pos]
        if expected is not None and item[1] != expected:
            raise CelUnsupported(f"expected {expected!r}, got {item[1]!r}")
        self.pos += 1
        return item

    def ternary(self) -> Expr:
        cond = self.binary(0)
        if self.peek() != "?":
            return cond
        self.take("?")
        then = self.ternary()
        self.take(":")
        other = self.ternary()
        return lambda env: then(env) if _bool(cond(env)) else other(env)

    _LEVELS: tuple[tuple[str, ...], ...] = (
        ("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">=", "in"), ("+", "-"), ("*", "/", "%"),
    )

    def binary(self, level: int) -> Expr:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in self._LEVELS[level]:
            op = self.take()[1]
            left = _binary(op, left, self.binary(level + 1))
        return left

    def unary(self) -> Expr:
        if self.peek() == "!":
            self.take()
            inner = self.unary()
            return lambda env: not _bool(inner(env))
        if self.peek() == "-":
            self.take()
            inner = self.unary()
            return lambda env: -inner(env)
        return self.member()

    def member(self) -> Expr:
        expr = self.primary()
        while self.peek() in (".", "["):
            if self.take()[1] == "[":
                index = self.ternary()
                self.take("]")
                expr = _index(expr, index)
                continue
            kind, name = self.take()
            if kind != "id":
                raise CelUnsupported(f"field name expected, got {name!r}")
            if self.peek() == "(":
                expr = self.method(expr, name)
            else:
                expr = _field(expr, name)
        return expr

    def method(self, target: Expr, name: str) -> Expr:
        self.take("(")
        if name in ("all", "exists"):
            var = self.take()[1]
            self.take(",")
            pred = self.ternary()
            self.take(")")
            test = all if name == "all" else any
            return lambda env: test(_bool(pred({**env, var: item}))
                                    for item in _iterable(target(env)))
        args = self.arguments()
        methods: dict[str, Callable[..., Any]] = {
            "size": len,
            "startsWith": str.startswith,
            "endsWith": str.endswith,
            "contains": lambda s, sub: sub in s,
            "matches": lambda s, pattern: re.search(pattern, s) is not None,
        }
        if name not in methods:
            raise CelUnsupported(f"method {name}()")
        fn = methods[name]
        return lambda env: fn(target(env), *(arg(env) for arg in args))

    def arguments(self, close: str = ")") -> list[Expr]:
        """Comma-separated expressions up to and including ``close``."""
        args: list[Expr] = []
        while self.peek() != close:
            args.append(self.ternary())
            if self.peek() == ",":
                self.take()
        self.take(close)
        return args

    def primary(self) -> Expr:
        kind, text = self.take()
        if kind == "num":
            number = float(text) if "." in text else int(text)
            return lambda env: number
        if kind == "str":
            string = text[1:-1].encode().decode("unicode_escape")
            return lambda env: string
        if text == "(":
            inner = self.ternary()
            self.take(")")
            return inner
        if text == "[":
            items = self.arguments("]")
            return lambda env: [item(env) for item in items]
        if kind != "id":
            raise CelUnsupported(f"unexpected {text!r}")
        constants = {"true": True, "false": False, "null": None}
        if text in constants:
            value = constants[text]
            return lambda env: value
        if self.peek() == "(":
            return self.function(text)
        if text == "oldSelf":
            raise CelUnsupported("transition rules (oldSelf) are not checked")
        return lambda env: _variable(env, text)

    def function(self, name: str) -> Expr:
        self.take("(")
        if name == "has":
            start = self.pos
            target = self.member()
            if not isinstance(getattr(target, "field", None), str):
                raise CelUnsupported(f"has() needs a field, got {self.items[start:self.pos]}")
            self.take(")")
            parent, field = target.parent, target.field  # type: ignore[attr-defined]
            return lambda env: isinstance(obj := parent(env), dict) and field in obj
        args = self.arguments()
        functions: dict[str, Callable[..., Any]] = {
            "size": len, "string": _string, "int": int, "double": float,
        }
        if name not in functions or len(args) != 1:
            raise CelUnsupported(f"function {name}()")
        fn = functions[name]
        return lambda env: fn(args[0](env))


def _variable(env: Env, name: str) -> Any:
    if name not in env:
        raise CelError(f"undeclared reference to {name!r}")
    return env[name]


def _field(parent: Expr, name: str) -> Expr:
    def get(env: Env) -> Any:
        obj = parent(env)
        if not isinstance(obj, dict) or name not in obj:
            raise CelError(f"no such key: {name}")
        return obj[name]

    get.parent, get.field = parent, name  # type: ignore[attr-defined]  # for has()
    return get


def _index(target: Expr, index: Expr) -> Expr:
    def get(env: Env) -> Any:
        obj, key = target(env), index(env)
        try:
            return obj[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise CelError(f"no such key: {key!r}") from exc

    return get


def _iterable(value: Any) -> Any:
    if not isinstance(value, list | dict):
        raise CelError(f"cannot iterate over {type(value).__name__}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"no matching overload: expected bool, got {type(value).__name__}")
    return value


def _string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _binary(op: str, left: Expr, right: Expr) -> Expr:
    if op == "&&":
        return lambda env: _bool(left(env)) and _bool(right(env))
    if op == "||":
        return lambda env: _bool(left(env)) or _bool(right(env))

    def arith(a: Any, b: Any) -> Any:
        if op == "/" and isinstance(a, int) and isinstance(b, int):
            if b == 0:
                raise CelError("division by zero")
            return int(a / b)  # CEL truncates toward zero
        if op == "%" and isinstance(a, int) and isinstance(b, int):
            if b == 0:
                raise CelError("modulus by zero")
            return a - b * int(a / b)
        operations = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
                      "/": lambda: a / b}
        return operations[op]()

    compare: dict[str, Callable[[Any, Any], Any]] = {
        "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
        "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
        "in": lambda a, b: a in b,
    }
    fn = compare.get(op, arith)

    def apply(env: Env) -> Any:
        try:
            return fn(left(env), right(env))
        except TypeError as exc:
            raise CelError(f"no matching overload for {op!r}") from exc

    return apply
