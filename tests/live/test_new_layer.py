"""A layer added the way the registry says (a folder and one line: add_toy_layer) compiles,
loads and records: the toy layer's rows are the calls the traced process made, one for one."""
from __future__ import annotations

import subprocess
import sys

import duckdb

from tests.helpers import live
from tests.unit.test_descriptors import add_toy_layer

pytestmark = live

CALLS = """
import os, sys
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    os.getppid()
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_toy_layer_records_every_call_of_the_traced_process(start_recorder, tmp_path):
    tree = tmp_path / "tree"
    env = add_toy_layer(tree)
    proc = subprocess.Popen([sys.executable, "-c", CALLS, "5000"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        rec = start_recorder("-p", str(proc.pid), "--layer", "toy", env=env, cwd=tree)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        assert rec.stop() == 0, "".join(rec.stderr_lines)
    finally:
        proc.kill()
        proc.wait()
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT layer, tgid, count(*) FROM io GROUP BY ALL").fetchall()
        lost = con.execute("SELECT lost FROM session").fetchone()[0]
    finally:
        con.close()
    print(f"toy layer: {rows}; lost {lost}")
    assert rows == [("toy", proc.pid, 5000)]
    assert '"ringbuf_reserve_failed": 0' in lost
