"""Layering contract (tests/layering.py RULES): checked on the source, function-level imports
included, and shown to catch violations planted in a fake package."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.layering import Violation, check, collect_imports, cycles, rule_violations

ROOT = Path(__file__).resolve().parents[2] / "kvprof"

# A fake kvprof that keeps the rules everywhere except in the places marked BREAKS.
FAKE = {
    "__init__.py": "",
    "__main__.py": "from kvprof.cli import main\n",
    "cli.py": "def main():\n    from kvprof.commands import top\n",
    "commands/__init__.py": "",
    "commands/top.py": "from kvprof.live import show\n",
    "live.py": "from kvprof.views.tui import app\n",
    # BREAKS: one command using another (line 1).
    "commands/compare.py": "from kvprof.commands.top import run\n",
    "units.py": "",
    "store/__init__.py": "",
    "store/session.py": "import duckdb\n",
    "views/__init__.py": "",
    "views/tui/__init__.py": "",
    # BREAKS: a view importing duckdb, hidden in a function (line 6).
    "views/tui/app.py": ("from textual.app import App\n"
                         "from kvprof.units import human_us\n"
                         "\n"
                         "\n"
                         "def load(path):\n"
                         "    import duckdb\n"
                         "    return duckdb.connect(path)\n"),
    "views/report.py": "from kvprof.views.findings import findings\n",
    # BREAKS: closes report -> findings -> report, only when the function runs (line 2).
    "views/findings.py": "def findings(summary):\n    from kvprof.views.report import WIDTH\n",
    "capture/__init__.py": "",
    "capture/bccload.py": ("import importlib\n\n\ndef load():\n"
                           "    return importlib.import_module('bcc')\n"),
    "capture/nvml.py": "def init():\n    import pynvml\n",
    # BREAKS: capture reaching up into phases, relative and inside a method (line 6).
    "capture/ebpf.py": ("from . import bccload\n"
                        "\n"
                        "\n"
                        "class Capture:\n"
                        "    def start(self):\n"
                        "        from ..phases import mark_server\n"),
    "phases/__init__.py": "",
    "phases/mark_server.py": "import pyarrow\n",
    # Allowed: the NVML phase source wraps the sampler.
    "phases/nvml.py": "from kvprof.capture.nvml import init\n",
    # BREAKS: bcc loaded by name outside capture (line 5).
    "commands/doctor.py": ("import importlib\n\n\ndef has_bcc():\n"
                           "    return importlib.import_module('bcc')\n"),
    # BREAKS: the store reaching up into a view (line 1).
    "store/parquet.py": "from kvprof.views import report\n",
}


def _fake_package(tmp_path: Path) -> Path:
    root = tmp_path / "kvprof"
    for rel, text in FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_kvprof_keeps_its_layering():
    problems = check(ROOT)
    if problems:
        pytest.fail("layering contract broken:\n" + "\n".join(problems), pytrace=False)


def test_checker_sees_function_level_imports_in_the_real_tree():
    # Guards against a checker that passes because it reads nothing: cli imports its verbs lazily.
    imports = collect_imports(ROOT)
    assert any(i.importer == "kvprof.cli" and i.imported == "kvprof.commands.top" for i in imports)


def test_checker_reports_exactly_the_planted_violations(tmp_path):
    imports = collect_imports(_fake_package(tmp_path))
    assert set(rule_violations(imports)) == {
        Violation("kvprof/views/tui/app.py", 6, "duckdb", "views never import duckdb"),
        Violation("kvprof/capture/ebpf.py", 6, "kvprof.phases.mark_server",
                  "capture only produces rows"),
        Violation("kvprof/commands/doctor.py", 5, "bcc", "bcc only in capture"),
        Violation("kvprof/store/parquet.py", 1, "kvprof.views.report",
                  "the store only keeps rows"),
        Violation("kvprof/commands/compare.py", 1, "kvprof.commands.top",
                  "only the CLI imports a command"),
    }
    found = [(c.modules, [(e.file, e.line) for e in c.edges]) for c in cycles(imports)]
    assert found == [(("kvprof.views.findings", "kvprof.views.report", "kvprof.views.findings"),
                      [("kvprof/views/findings.py", 2), ("kvprof/views/report.py", 1)])]


def test_fake_package_without_the_planted_violations_passes(tmp_path):
    root = _fake_package(tmp_path)
    (root / "views/tui/app.py").write_text("from textual.app import App\n")
    (root / "views/findings.py").write_text("WIDTH = 80\n")
    (root / "capture/ebpf.py").write_text("from . import bccload\n")
    (root / "commands/doctor.py").write_text("")
    (root / "store/parquet.py").write_text("")
    (root / "commands/compare.py").write_text("")
    assert check(root) == []
