"""Hold numpy's copies of the probes' C structs and codes to what the compiler made of the C.

The item size alone cannot tell two fields of one size swapped in the C, or a code renumbered
on one side: rows would be read from the wrong bytes, silently. So at load every dtype is
compared field by field, offsets included, with bcc's key and leaf types of the maps carrying
it, and every code with its #define in the compiled text. A difference is a bug in kvprof: it
fails the load in one line, before any data is read."""
from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from kvprof.errors import EX_SOFTWARE, KvprofError

_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+(.+)$", re.M)
# (a comment may go on past the line: the rest of it is dropped)
_COMMENT = re.compile(r"/\*.*?(\*/|$)|//.*$")
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")
# What integer #defines are made of; C's `/` on integers is Python's `//`.
_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_, ast.Add: operator.add, ast.Sub: operator.sub,
    ast.Mult: operator.mul, ast.Div: operator.floordiv}
_UNARY: dict[type[ast.unaryop], Callable[[int], int]] = {ast.USub: operator.neg,
                                                          ast.Invert: operator.invert}


@dataclass(frozen=True)
class Struct:
    """A C struct numpy reads, and a map of the probes whose key or value type it is: bcc
    builds that type from clang's layout, the one place outside the object code where the
    compiled layout can be read."""

    name: str  # as in the C, without `struct`
    dtype: np.dtype
    module: str  # the Python module defining `dtype` (its __name__)
    table: str
    part: str = "Leaf"  # or "Key"
    field: str | None = None  # the struct is the element type of this field of the value
    c_file: str = "kvprof/layers/kvprof.h"


@dataclass(frozen=True)
class Code:
    """A number Python uses that the C #defines."""

    macro: str
    value: int
    module: str  # the Python module that sets `value` (its __name__)
    c_file: str = "kvprof/layers/kvprof.h"


def _path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _value(node: ast.AST, known: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id in known:
        return known[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left, known), _value(node.right, known))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, known))
    raise ValueError("not an integer constant")


def int_defines(text: str, cflags: tuple[str, ...] = ()) -> dict[str, int]:
    """The object-like #defines of `text` whose value is an integer constant expression,
    with the -D values of `cflags` in place of the defaults they override."""
    known: dict[str, int] = {}
    for flag in cflags:
        name, _, value = flag.removeprefix("-D").partition("=")
        if flag.startswith("-D") and value.lstrip("-").isdigit():
            known[name] = int(value)
    given = set(known)
    for name, body in _DEFINE.findall(text):
        if name in given:
            continue
        expr = _INT_SUFFIX.sub(r"\1", _COMMENT.sub("", body)).strip()
        try:
            known[name] = _value(ast.parse(expr, mode="eval").body, known)
        except (SyntaxError, ValueError):
            continue  # a type, a string, a statement: not a code
    return known


def check_codes(defines: dict[str, int], codes: list[Code], families: dict[str, str]) -> None:
    """Each code's value against the C's. `families`: macro prefix -> C file; every macro of
    one must be among `codes`, so a code added in the C alone fails too."""
    for c in codes:
        if c.macro not in defines:
            _fail(f"{c.c_file} has no integer #define {c.macro}, which {_path(c.module)} "
                  "reads")
        if defines[c.macro] != c.value:
            _fail(f"{c.c_file} {c.macro} is {defines[c.macro]} in the C, {c.value} in "
                  f"{_path(c.module)}")
    named = {c.macro for c in codes}
    for prefix, c_file in families.items():
        for macro in sorted(defines):
            if macro.startswith(prefix) and macro not in named:
                _fail(f"{c_file} {macro} = {defines[macro]} has no counterpart in kvprof")


def check_structs(bpf: Any, structs: list[Struct]) -> None:
    """Each struct's dtype against the type bcc built for its map (bpf: the loaded BPF)."""
    for s in structs:
        try:
            table = bpf[s.table]
        except KeyError:
            _fail(f"{s.c_file}: no map {s.table}, whose type says how struct {s.name} is laid "
                  "out")
        # A per-CPU map's Leaf is an array of the value, one per CPU; sLeaf is the value.
        ctype = table.Key if s.part == "Key" else getattr(table, "sLeaf", table.Leaf)
        c = np.dtype(ctype)
        if s.field is not None:
            if s.field not in (c.names or ()):
                _fail(f"{s.c_file}: the value of map {s.table} has no field '{s.field}' "
                      f"holding struct {s.name}")
            c = c.fields[s.field][0].base
        check_struct(c, s.dtype, s.name, s.c_file, _path(s.module))


def check_struct(c: np.dtype, py: np.dtype, struct: str, c_file: str, py_file: str) -> None:
    """`c`: numpy's reading of the ctypes type bcc built from clang's layout (offsets and
    padding as clang placed them). Every field of `py` against `c`'s of that name: same
    offset and size, and the same kind of number (an opaque `V` field in `py` may cover any
    bytes: padding); and no field of `c` left out."""
    where = f"{c_file} struct {struct}"
    py_fields: Mapping[str, tuple[Any, ...]] = py.fields or {}
    c_fields = {n: f for n, f in (c.fields or {}).items() if not n.startswith("__pad")}
    for name, (py_type, py_off, *_) in py_fields.items():
        if name not in c_fields:
            _fail(f"{where}: no field '{name}' in the C, but one in {py_file}")
        c_type, c_off = c_fields[name][:2]
        if c_off != py_off:
            _fail(f"{where}: field '{name}' at offset {c_off} in the C, {py_off} in {py_file}")
        if c_type.itemsize != py_type.itemsize:
            _fail(f"{where}: field '{name}' is {c_type.itemsize} bytes in the C, "
                  f"{py_type.itemsize} in {py_file}")
        c_base, py_base = c_type.base, py_type.base
        if py_base.names is not None and c_base.names is not None:
            check_struct(c_base, py_base, f"{struct}.{name}", c_file, py_file)
        elif py_base.kind not in "VS" and (c_base.kind, c_base.itemsize) != \
                (py_base.kind, py_base.itemsize):
            _fail(f"{where}: field '{name}' holds {c_base} in the C, {py_base} in {py_file}")
        elif py_base.kind == "S" and c_base.kind != "S":
            _fail(f"{where}: field '{name}' holds {c_base} in the C, text in {py_file}")
    missing = [n for n in c_fields if n not in py_fields]
    if missing:
        _fail(f"{where}: field '{missing[0]}' of the C is not in {py_file}")
    if c.itemsize != py.itemsize:
        _fail(f"{where}: {c.itemsize} bytes in the C, {py.itemsize} in {py_file}")


def _fail(message: str) -> NoReturn:
    raise KvprofError(message, EX_SOFTWARE,
                      hint="a bug in kvprof: its probes and the code reading them disagree")
