"""Prometheus text exposition (0.0.4, and the OpenMetrics subset exporters write) to samples.

Hand-written rather than `prometheus_client.parser`, which is several times slower on a large
vLLM page (too slow for 10 scrapes a second), accepts text after the timestamp and does not say
which line is wrong. What prometheus_client writes is read exactly as it reads it (escapes, the
unknown kept as written, UTF-8 quoted names, timestamps, exemplars, `+Inf`, `NaN`; tests hold this).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Go's ParseFloat spellings that exporters actually write; float() alone would also take
# "1_000" or "infinity", which no exporter writes and which only a wrong page would hold.
_VALUE = re.compile(r"[+-]?(?:Inf|inf|NaN|nan|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_TIMESTAMP = re.compile(r"-?\d+(?:\.\d+)?")
_PLAIN = re.compile(r'[^"\\]*')
_BLANKS = " \t"
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _skip(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] in _BLANKS:
        pos += 1
    return pos


def _quoted(line: str, pos: int) -> tuple[str, int]:
    """The string that starts with the quote at pos, unescaped, and the position after it."""
    parts = []
    pos += 1
    while True:
        m = _PLAIN.match(line, pos)
        assert m is not None  # _PLAIN matches the empty string too
        parts.append(m.group())
        pos = m.end()
        if pos >= len(line):
            raise ValueError("unterminated string")
        if line[pos] == '"':
            return "".join(parts), pos + 1
        if pos + 1 >= len(line):
            raise ValueError("unterminated string")
        nxt = line[pos + 1]
        # Unknown escapes are kept as written, as Prometheus itself does.
        parts.append(_ESCAPES.get(nxt, "\\" + nxt))
        pos += 2


def _labels(line: str, pos: int, want_name: bool) -> tuple[str | None, dict[str, str], int]:
    """Parse from just after '{' to just after '}'. Prometheus 3 may quote a UTF-8 metric
    name as the first item inside the braces; want_name allows that."""
    labels: dict[str, str] = {}
    name = None
    first = True
    while True:
        pos = _skip(line, pos)
        if pos >= len(line):
            raise ValueError("unterminated label set")
        if line[pos] == "}":
            return name, labels, pos + 1
        if line[pos] == '"':
            key, pos = _quoted(line, pos)
            quoted = True
        else:
            m = _LABEL_NAME.match(line, pos)
            if not m:
                raise ValueError(f"bad label name at column {pos + 1}")
            key, pos = m.group(), m.end()
            quoted = False
        pos = _skip(line, pos)
        if pos < len(line) and line[pos] == "=":
            pos = _skip(line, pos + 1)
            if pos >= len(line) or line[pos] != '"':
                raise ValueError(f"label {key!r} has no quoted value")
            value, pos = _quoted(line, pos)
            if key in labels:
                raise ValueError(f"duplicate label {key!r}")
            labels[key] = value
        elif want_name and first and quoted:
            name = key
        else:
            raise ValueError(f"expected '=' after {key!r}")
        first = False
        pos = _skip(line, pos)
        if pos < len(line) and line[pos] == ",":
            pos += 1
        elif pos >= len(line) or line[pos] != "}":
            raise ValueError(f"expected ',' or '}}' at column {pos + 1}")


def _sample(line: str) -> Sample:
    m = _METRIC_NAME.match(line)
    name = m.group() if m else None
    pos = m.end() if m else 0
    labels: dict[str, str] = {}
    brace = _skip(line, pos)
    if brace < len(line) and line[brace] == "{":
        inner, labels, pos = _labels(line, brace + 1, want_name=name is None)
        name = name or inner
    if not name:
        raise ValueError("no metric name")
    if pos >= len(line) or line[pos] not in _BLANKS:
        raise ValueError(f"{name}: no value")
    fields = line[pos:].split()
    if not _VALUE.fullmatch(fields[0]):
        raise ValueError(f"{name}: bad value {fields[0][:20]!r}")
    rest = fields[1:]
    if rest and rest[0] != "#":  # an optional timestamp, then perhaps an OpenMetrics exemplar
        if not _TIMESTAMP.fullmatch(rest[0]):
            raise ValueError(f"{name}: bad timestamp {rest[0][:20]!r}")
        rest = rest[1:]
    if rest and rest[0] != "#":
        raise ValueError(f"{name}: trailing text")
    return Sample(name, labels, float(fields[0]))


# The common line, checked whole by one regex: a bare name, plain labels, a value, perhaps a
# timestamp. Scraping a large endpoint 10 times a second makes the per-character parser too
# slow to run on every line; it handles what this does not match (and says what is wrong).
_LABEL_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_FAST_LINE = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL_PAIR}(?:,{_LABEL_PAIR})*,?)?)\}})?"
    rf"[ \t]+({_VALUE.pattern})"
    rf"(?:[ \t]+{_TIMESTAMP.pattern})?")
_FAST_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*(?:\\.[^"\\]*)*)"')
_UNESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _UNESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group()), value)


def parse_exposition(text: str, keep: Callable[[str], bool] | None = None) -> list[Sample]:
    """Samples of Prometheus text exposition (0.0.4, also the OpenMetrics subset that
    exporters write). Comments, HELP and TYPE lines are skipped; ValueError names the first
    line that is not exposition, e.g. an HTML page. `keep(name)`, when given, picks the
    samples to return; every line's syntax is still checked, its labels' names (a duplicate)
    only where it is kept: reading those of every line of a large endpoint is the cost the
    filter saves."""
    samples = []
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip(" \t\r")
        if not line or line[0] == "#":
            continue
        m = _FAST_LINE.fullmatch(line)
        if m is not None:
            name = m.group(1)
            if keep is None or keep(name):
                pairs = _FAST_PAIR.findall(m.group(2)) if m.group(2) else ()
                labels = {k: _unescape(v) for k, v in pairs}
                if len(labels) != len(pairs):
                    raise ValueError(f"line {lineno}: {name}: duplicate label")
                samples.append(Sample(name, labels, float(m.group(3))))
            continue
        try:
            s = _sample(line)
        except ValueError as e:
            raise ValueError(f"line {lineno}: {e}: {line[:60]!r}") from None
        if keep is None or keep(s.name):
            samples.append(s)
    return samples
