"""ruff over the tree and mypy over the package, as pyproject.toml configures them. mypy follows
the report's keys (kvprof/summary.py) into every view, so a renamed or misspelt key fails here,
not in one view at run time; it is strict in the modules that define and build those types."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_fails_a_view_reading_a_key_the_report_does_not_have(tmp_path):
    """The check has teeth: a view that reads `time_idle` (the report says `time_idle_pct`)
    is refused with the key named."""
    view = tmp_path / "view.py"
    view.write_text("from kvprof.summary import PhaseStats\n\n\n"
                    "def idle(ph: PhaseStats) -> float | None:\n"
                    "    return ph['block']['time_idle']\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(view)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and '"time_idle"' in r.stdout, r.stdout


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_checks_the_bodies_of_unannotated_functions(tmp_path):
    """check_untyped_defs is on: a wrong key read inside a function with no annotations fails."""
    view = tmp_path / "untyped.py"
    view.write_text("from kvprof.summary import PhaseStats\n\n\n"
                    "def idle(ph):\n"
                    "    stats: PhaseStats = ph\n"
                    "    return stats['block']['time_idle']\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(view)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and '"time_idle"' in r.stdout, r.stdout
