"""Each capture layer and each phase source is described once; a part forgotten fails here.

`layer_problems` and `source_problems` hold a descriptor table against what it must agree
with (the layer folders' probes, the registry, `kvprof record -h`). They are run on
the real tables, and on tables given a descriptor that forgets a part, as someone adding a
layer or a source might: each such slip must be named, not found by a user.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

from kvprof import cli, layers, privileges, roles, schema, system
from kvprof.capture import btf, ebpf
from kvprof.layers import Layer
from kvprof.phases import registry
from kvprof.phases.registry import PhaseSourceKind

PROBES = layers.DIR
LAYER_HELP_COLUMNS = 68  # beside a 12-column name: 80 in all
SOURCE_HELP_COLUMNS = 53  # beside a 27-column usage


def record_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["record"].format_help()


def attached(probe_text: str) -> tuple[set[str], set[str]]:
    """The (classic "group/name", raw "name") tracepoints a probe file attaches."""
    classic = {f"{g}/{n}" for g, n in
               re.findall(r"^\s*TRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)", probe_text, re.M)}
    raw = set(re.findall(r"^\s*RAW_TRACEPOINT_PROBE\(\s*(\w+)\s*\)", probe_text, re.M))
    return classic, raw


def layer_problems(table: tuple[Layer, ...] | None = None, probes: Path = PROBES,
                   help_text: str | None = None) -> list[str]:
    """Everything a layer table gets wrong, one line each; empty when it holds."""
    table = layers.LAYERS if table is None else table
    help_text = record_help() if help_text is None else help_text
    out = []
    names = [x.name for x in table]
    if len(set(names)) != len(names):
        out.append(f"layer names repeat: {names}")
    for folder in sorted(d.name for d in probes.iterdir() if (d / layers.PROBE).is_file()):
        if folder not in names:
            out.append(f"kvprof/layers/{folder}/ holds a probe, and no layer in the registry "
                       "is named so")
    device = [x.device for x in table]
    if device != sorted(device, reverse=True):
        out.append("device layers must come first (views index them by code)")
    for i, x in enumerate(table):
        where = f"layer {x.name!r}"
        if x.code != i:
            out.append(f"{where}: code {x.code} is not its index {i} in the table")
        probe = probes / x.name / layers.PROBE
        path = f"kvprof/layers/{x.name}/{layers.PROBE}"
        if not probe.is_file():
            out.append(f"{where}: {path} does not exist")
        else:
            classic, raw = attached(probe.read_text())
            listed_raw = {t for t in x.tracepoints if t.split("/", 1)[-1] in x.raw_args}
            want_classic = (set(x.tracepoints) - listed_raw) | set(x.optional_tracepoints)
            for tp in sorted(want_classic - classic):
                out.append(f"{where}: lists tracepoint {tp}, which {path} does not attach")
            for tp in sorted(classic - want_classic):
                out.append(f"{where}: {path} attaches tracepoint {tp}, which the descriptor "
                           "does not list")
            for tp in sorted(set(x.raw_args) ^ raw):
                out.append(f"{where}: raw tracepoint {tp} is in "
                           + ("raw_args only" if tp in x.raw_args else f"{path} only"))
        for tp in sorted(set(x.raw_args) - {t.split("/", 1)[-1] for t in x.tracepoints}):
            out.append(f"{where}: raw_args names {tp}, which its tracepoints do not")
        for tp in x.tracepoints + x.optional_tracepoints:
            if not re.fullmatch(r"\w+/\w+", tp):
                out.append(f"{where}: tracepoint {tp!r} is not group/name")
        for cap in x.privileges:
            if cap not in privileges.CAP_NUMBERS:
                out.append(f"{where}: privilege {cap} is not one privileges.py knows")
        if not x.help or len(x.help) > LAYER_HELP_COLUMNS:
            out.append(f"{where}: needs a help line of 1..{LAYER_HELP_COLUMNS} characters")
        elif not re.search(rf"^  {re.escape(x.name)}\s+{re.escape(x.help)}$", help_text, re.M):
            out.append(f"{where}: not listed in `kvprof record -h`")
    return out


def _source_class(k: PhaseSourceKind) -> type | None:
    """The class an entry's `source` names, when kvprof/phases has it."""
    module, _, name = (k.source or "").partition(":")
    if not (registry.__file__ and (Path(registry.__file__).parent / f"{module}.py").is_file()):
        return None
    found = getattr(import_module(f"kvprof.phases.{module}"), name, None)
    return found if isinstance(found, type) else None


def source_problems(table: tuple[PhaseSourceKind, ...] | None = None,
                    help_text: str | None = None) -> list[str]:
    """Everything a phase source's entry in the registry gets wrong, one line each."""
    table = registry.PHASE_SOURCES if table is None else table
    help_text = record_help() if help_text is None else help_text
    out = []
    kinds = [k.kind for k in table]
    if len(set(kinds)) != len(kinds):
        out.append(f"phase source kinds repeat: {kinds}")
    ranks: dict[str, set[int]] = {}
    for k in table:
        where = f"phase source {k.kind!r}"
        if k.source is not None:
            cls = _source_class(k)
            if cls is None:
                out.append(f"{where}: its source {k.source} is not a class in kvprof/phases")
            elif getattr(cls, "name", None) != k.kind:
                out.append(f"{where}: its source {k.source} is named "
                           f"{getattr(cls, 'name', None)!r}")
        if k.discover is not None and k.source is None:
            out.append(f"{where}: discovered but never built")
        if k.label is not None and k.rank is None:
            out.append(f"{where}: brings windows labelled {k.label!r} but has no rank")
        if k.rank is not None and k.label is None:
            out.append(f"{where}: has a rank but no label for its windows")
        if k.label is not None and k.rank is not None:
            ranks.setdefault(k.label, set()).add(k.rank)
        if k.default_target and not k.target:
            out.append(f"{where}: has a default target but takes none")
        for figure, pairs in k.means.items():
            if not all(len(p) == 2 and all(isinstance(n, str) for n in p) for p in pairs):
                out.append(f"{where}: engine figure {figure} is not (sum, count) pairs")
        for pattern, _ in k.roles:
            try:
                re.compile(pattern)
            except re.error as e:
                out.append(f"{where}: role pattern {pattern!r}: {e}")
        if not k.help or len(k.help) > SOURCE_HELP_COLUMNS:
            out.append(f"{where}: needs a help line of 1..{SOURCE_HELP_COLUMNS} characters")
        elif not re.search(rf"^  {re.escape(cli.source_usage(k))}\s+{re.escape(k.help)}$",
                           help_text, re.M):
            out.append(f"{where}: not listed in `kvprof record -h`")
    for label, seen in ranks.items():
        if len(seen) > 1:
            out.append(f"windows labelled {label!r} are given several ranks: {sorted(seen)}")
    return out


# -- the real tables ------------------------------------------------------------------------

def test_every_layer_is_complete_and_agrees_with_its_probe():
    assert layer_problems() == []


def test_every_phase_source_is_complete():
    assert source_problems() == []


def test_the_old_names_follow_the_layer_table():
    assert schema.LAYERS == tuple(x.name for x in layers.LAYERS)
    assert schema.DEVICE_LAYERS == tuple(x.name for x in layers.LAYERS if x.device)
    assert [ebpf.LAYER_BLOCK, ebpf.LAYER_URING, ebpf.LAYER_SYSCALL, ebpf.LAYER_TCP,
            ebpf.LAYER_GDS] == [schema.LAYERS.index(n) for n in
                                ("block", "io_uring", "syscall", "tcp", "gds")]
    # Every tracepoint a layer needs is checked by doctor and before recording.
    assert system.TRACEPOINTS == {x.name: x.tracepoints for x in layers.LAYERS if x.tracepoints}
    assert {t for tps in system.TRACEPOINTS.values() for t in tps} >= {
        f"{x.tracepoints[0].split('/')[0]}/{name}" for x in layers.LAYERS for name in x.raw_args}
    assert set(btf.TRACEPOINTS) == set(btf.FIELDS) == {x.name for x in layers.LAYERS
                                                        if x.raw_args}
    for x in layers.LAYERS:
        assert privileges.needed((x.name,)) == {privileges.CAP_NUMBERS[c] for c in x.privileges}


def test_the_cli_offers_exactly_the_layers_and_sources():
    record = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["record"]
    layer = next(a for a in record._actions if a.dest == "layer")
    assert list(layer.choices) == list(schema.LAYERS)
    for k in registry.PHASE_SOURCES:
        assert registry.parse(k.kind + (f"={k.default_target or 'x'}" if k.target else "")).kind \
            == k.kind


def test_the_default_is_the_block_layer_and_p_brings_the_process_layers(monkeypatch):
    """`record` with no --layer traces the block layer alone; -p or --cgroup add the process
    layers (io_uring among them) the kernel has; --layer names exactly what runs."""
    from kvprof.recorder.options import RecordOptions, layers_from_args

    monkeypatch.setattr(system, "tracepoint_available", lambda tp: True)
    parse = cli.build_parser().parse_args
    assert layers_from_args(parse(["record", "-d", "loop0"])) == ("block",)
    assert RecordOptions().layers == ("block",)
    with_p = layers_from_args(parse(["record", "-d", "loop0", "-p", "1"]))
    assert with_p[0] == "block" and {"io_uring", "syscall", "tcp"} <= set(with_p)
    assert layers_from_args(parse(["record", "--layer", "io_uring"])) == ("io_uring",)


def test_schema_and_roles_take_their_figures_from_the_sources():
    assert schema.SOURCE_RANK == {"hook": 3, "manual": 3, "metrics": 2, "nvml": 1}
    assert set(schema.ENGINE_MEANS) == {"ttft_s", "itl_s", "prefix_cache_hit_share"}
    # The first pair a session has is used: the plugin's (exact to the step), then vLLM's
    # own before the older spelling.
    assert [pair[0] for pair in schema.ENGINE_MEANS["itl_s"][:3]] == [
        "vllm-plugin:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_sum",
        "vllm:time_per_output_token_seconds_sum"]
    # One engine's tokens once: the plugin's or the scrape's, not both.
    assert schema.TOKENS_BY_ENGINE["prompt_tokens"] == (
        ("vllm-plugin:prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("sglang:prompt_tokens_total",))
    # Windows on the marker socket carry only their own sources' series.
    assert schema.MARK_SERIES and all(n.startswith("vllm-plugin:") for n in schema.MARK_SERIES)
    assert all(pair in schema.ENGINE_MEANS[f] for k in registry.PHASE_SOURCES
               for f, pairs in k.means.items() for pair in pairs)
    assert roles.role("VLLM::EngineCore_DP0") == "vllm EngineCore"
    assert roles.role("text-generation-router --port 1") == "tgi router"


class FakeSampler:
    """Stands in for NVML on a host without a GPU: only the builder's wiring is tested."""

    def __init__(self, gpus=None, on_lost=None):
        self.gpu_indices = []


@pytest.mark.parametrize("kind", [k.kind for k in registry.PHASE_SOURCES if k.source])
def test_every_built_source_is_constructible(kind, monkeypatch):
    from kvprof.phases import nvml

    monkeypatch.setattr(nvml, "NvmlSampler", FakeSampler)
    facts = registry.PHASE_SOURCE_KINDS[kind]
    target = facts.default_target or ("tcp://127.0.0.1:1" if facts.target else None)
    source = registry.build(registry.parse(kind + (f"={target}" if target else "")))
    assert source.name == kind


# -- descriptors that forget a part ----------------------------------------------------------

def fake_layer(**changes) -> Layer:
    return dataclasses.replace(layers.TCP, name="fake", code=len(layers.LAYERS), **changes)


def test_a_layer_without_a_probe_file_fails(monkeypatch):
    monkeypatch.setattr(layers, "LAYERS", layers.LAYERS + (fake_layer(),))
    assert layer_problems() == ["layer 'fake': kvprof/layers/fake/probe.bpf.c does not exist"]


def test_a_layer_listing_tracepoints_its_probe_does_not_attach_fails(monkeypatch):
    tcp = dataclasses.replace(layers.TCP, tracepoints=layers.TCP.tracepoints[:-1]
                              + ("sock/sock_rcvqueue_full",))
    monkeypatch.setattr(layers, "LAYERS", layers.LAYERS[:3] + (tcp,) + layers.LAYERS[4:])
    assert layer_problems() == [
        "layer 'tcp': lists tracepoint sock/sock_rcvqueue_full, which "
        "kvprof/layers/tcp/probe.bpf.c does not attach",
        "layer 'tcp': kvprof/layers/tcp/probe.bpf.c attaches tracepoint sock/inet_sock_set_state, "
        "which the descriptor does not list"]


def test_a_layer_whose_raw_tracepoints_differ_from_its_probe_fails(monkeypatch):
    args = dict(layers.BLOCK.raw_args)
    del args["block_rq_requeue"]
    block = dataclasses.replace(layers.BLOCK, raw_args=args)
    monkeypatch.setattr(layers, "LAYERS", (block,) + layers.LAYERS[1:])
    assert "layer 'block': raw tracepoint block_rq_requeue is in " \
        "kvprof/layers/block/probe.bpf.c only" in layer_problems()


def test_a_layer_with_an_unknown_privilege_or_no_help_fails(monkeypatch):
    monkeypatch.setattr(layers, "LAYERS", layers.LAYERS[:-1] + (dataclasses.replace(
        layers.GDS, privileges=("CAP_SYS_NICE",), help=""),))
    assert layer_problems() == [
        "layer 'gds': privilege CAP_SYS_NICE is not one privileges.py knows",
        f"layer 'gds': needs a help line of 1..{LAYER_HELP_COLUMNS} characters"]


def test_a_layer_missing_from_the_cli_fails(monkeypatch):
    help_before = record_help()  # as if the CLI listed its layers by hand
    monkeypatch.setattr(layers, "LAYERS", layers.LAYERS + (fake_layer(),))
    assert "layer 'fake': not listed in `kvprof record -h`" in layer_problems(
        help_text=help_before)


FAKE = PhaseSourceKind("fake-hook", "a fake engine hook", label="fake", rank=3)


def add_source(monkeypatch, kind: PhaseSourceKind) -> None:
    monkeypatch.setattr(registry, "PHASE_SOURCES", registry.PHASE_SOURCES + (kind,))


def test_a_source_without_a_rank_fails(monkeypatch):
    add_source(monkeypatch, dataclasses.replace(FAKE, rank=None))
    assert source_problems() == [
        "phase source 'fake-hook': brings windows labelled 'fake' but has no rank"]


def test_a_source_the_registry_cannot_build_fails(monkeypatch):
    add_source(monkeypatch, dataclasses.replace(FAKE, source="metrics:FakeHook"))
    assert source_problems() == [
        "phase source 'fake-hook': its source metrics:FakeHook is not a class in kvprof/phases"]
    monkeypatch.setattr(registry, "PHASE_SOURCES", registry.PHASE_SOURCES[:-1] + (
        dataclasses.replace(FAKE, source="metrics:VllmMetrics"),))
    assert source_problems() == [
        "phase source 'fake-hook': its source metrics:VllmMetrics is named 'vllm-metrics'"]
    monkeypatch.setattr(registry, "PHASE_SOURCES", registry.PHASE_SOURCES[:-1] + (
        dataclasses.replace(FAKE, discover=registry.PHASE_SOURCE_KINDS["vllm-metrics"].discover),))
    assert source_problems() == ["phase source 'fake-hook': discovered but never built"]


def test_a_source_missing_from_the_cli_help_fails(monkeypatch):
    help_before = record_help()  # as if the CLI listed its sources by hand
    add_source(monkeypatch, FAKE)
    assert source_problems(help_text=help_before) == [
        "phase source 'fake-hook': not listed in `kvprof record -h`"]
    monkeypatch.setattr(registry, "PHASE_SOURCES", registry.PHASE_SOURCES[:-1]
                        + (dataclasses.replace(FAKE, help=""),))
    assert source_problems() == [
        f"phase source 'fake-hook': needs a help line of 1..{SOURCE_HELP_COLUMNS} characters"]


def test_a_label_given_two_ranks_fails(monkeypatch):
    add_source(monkeypatch, dataclasses.replace(FAKE, label="metrics"))
    assert source_problems() == ["windows labelled 'metrics' are given several ranks: [2, 3]"]


# -- a layer added as a newcomer would: its folder, and one line in the registry ----------

TOY_PROBE = """/* toy: one row per getppid() call of the traced processes. */
#include "../kvprof.h"

TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
    struct kvprof_io e = {};
    if (!kvprof_task_row(&e))
        return 0;
    e.layer = KVPROF_LAYER_TOY;
    kvprof_emit(&e);
    return 0;
}
"""
TOY_DESCRIPTOR = """from kvprof.layers.layer import Layer

LAYER = Layer("toy", 5, device=False, help="the traced processes' getppid() calls",
              tracepoints=("syscalls/sys_enter_getppid",))
"""


def add_toy_layer(root: Path) -> dict:
    """A copy of the kvprof package under `root`, given a layer more the way the registry
    says: a folder (probe and descriptor) and one line. Returns an environment whose Python
    imports that copy (run from `root`: a current directory holding kvprof/ would win)."""
    shutil.copytree(Path(layers.__file__).parents[1], root / "kvprof",
                    ignore=shutil.ignore_patterns("__pycache__"))
    toy = root / "kvprof" / "layers" / "toy"
    toy.mkdir()
    (toy / layers.PROBE).write_text(TOY_PROBE)
    (toy / "__init__.py").write_text(TOY_DESCRIPTOR)
    registry_file = root / "kvprof" / "layers" / "__init__.py"
    text = registry_file.read_text()
    assert text.count('    "gds",\n') == 1
    registry_file.write_text(text.replace('    "gds",\n', '    "gds",\n    "toy",\n'))
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{Path(__file__).parents[2]}"}


TOY_CHECK = """
import json
from kvprof import layers, schema
from kvprof.capture import ebpf
from tests.unit.test_descriptors import layer_problems
program = ebpf.build_program(("toy",), ebpf.CaptureFilter())
print(json.dumps({"from": layers.__file__, "layers": schema.LAYERS, "problems": layer_problems(),
                  "probe": "sys_enter_getppid" in program.text,
                  "code": "-DKVPROF_LAYER_TOY=5" in program.cflags}))
"""


def test_a_layer_is_its_folder_and_one_registry_line(tmp_path):
    env = add_toy_layer(tmp_path)
    r = subprocess.run([sys.executable, "-c", TOY_CHECK], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"from": str(tmp_path / "kvprof" / "layers" / "__init__.py"),
                   "layers": ["block", "io_uring", "syscall", "tcp", "gds", "toy"],
                   "problems": [], "probe": True, "code": True}


def test_a_layer_folder_left_out_of_the_registry_fails(tmp_path):
    shutil.copytree(PROBES, tmp_path / "layers")
    (tmp_path / "layers" / "toy").mkdir()
    (tmp_path / "layers" / "toy" / layers.PROBE).write_text(TOY_PROBE)
    assert layer_problems(probes=tmp_path / "layers") == [
        "kvprof/layers/toy/ holds a probe, and no layer in the registry is named so"]
