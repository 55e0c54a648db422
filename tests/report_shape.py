"""Checks a report (JSON-decoded) against kvprof/summary.py's types, key for key: every
required key present, no key the types do not name, every value of its declared type. The
types are the schema; this is what keeps them the schema of what kvprof really produces.
"""
from __future__ import annotations

import types
import typing
from typing import Any, get_args, get_origin, get_type_hints


def check(value: Any, tp: Any, path: str = "report") -> None:
    """Raise AssertionError naming the first place `value` is not a `tp`."""
    origin = get_origin(tp)
    if tp is Any:
        return
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            try:
                check(value, arm, path)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{path}: {value!r:.80} is none of {tp}: {errors}")
    if tp is type(None):
        assert value is None, f"{path}: {value!r:.80} is not null"
        return
    if typing.is_typeddict(tp):
        assert isinstance(value, dict), f"{path}: {type(value).__name__}, not an object"
        hints = get_type_hints(tp)
        missing = tp.__required_keys__ - value.keys()
        extra = value.keys() - hints.keys()
        assert not missing, f"{path}: missing {sorted(missing)} ({tp.__name__})"
        assert not extra, f"{path}: keys {sorted(extra)} not in {tp.__name__}"
        for k, v in value.items():
            check(v, hints[k], f"{path}.{k}")
        return
    if origin is dict:
        kt, vt = get_args(tp)
        assert isinstance(value, dict), f"{path}: {type(value).__name__}, not an object"
        for k, v in value.items():
            check(k, kt, f"{path} key")
            check(v, vt, f"{path}.{k}")
        return
    if origin is list:
        (it,) = get_args(tp)
        assert isinstance(value, list), f"{path}: {type(value).__name__}, not a list"
        for i, v in enumerate(value):
            check(v, it, f"{path}[{i}]")
        return
    # JSON numbers: an int is a float where a float is declared; a bool is never a number.
    ok = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}[tp]
    assert isinstance(value, ok) and (tp is bool or not isinstance(value, bool)), \
        f"{path}: {value!r:.80} is not {tp.__name__}"
