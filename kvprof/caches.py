"""Which KV cache a file belongs to, from its path: the one place these rules live
(docs/report.md).

A rule is a name and a glob matched against the file's whole absolute path (`*` also crosses
`/`); first match wins, users' own (`--cache NAME=GLOB`) in front, `other` when none does."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvprof.errors import EX_USAGE, KvprofError

OTHER = "other"


@dataclass(frozen=True)
class Rule:
    name: str
    glob: str


# The offload backends' file layouts (../shared/reference/engines.md).
BUILTIN = (
    # LMCache's local disk backend: one `model@world_size@worker_id@hash@dtype.pt` per chunk
    # (layer-wise and tagged keys add `@...` parts).
    Rule("lmcache-disk", "*/*@*@*@*@*.pt"),
    # vLLM's fs tier: `<root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin`, and the
    # temp files it renames into place there.
    Rule("vllm-fs-tier", "*/*_r[0-9]*/[0-9a-f][0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]_g*/*"),
    # vLLM's simple CPU offload disk backend: one `<disk_path>.rank_<n>` file.
    Rule("vllm-disk-offload", "*.rank_[0-9]*"),
    # SGLang HiCache's file backend: `<key>_<model>_<tp_rank>_<tp_size>....bin` per page, and
    # its `.<uuid>.tmp` files under the default /tmp/hicache.
    Rule("sglang-hicache", "*/*_*_[0-9]*_[0-9]*.bin"),
    Rule("sglang-hicache", "*/hicache/*"),
)


def parse(specs: list[str]) -> tuple[Rule, ...]:
    """`--cache NAME=GLOB` options, in front of the built-in rules."""
    rules = []
    for spec in specs:
        name, sep, glob = spec.partition("=")
        if not sep or not name.strip() or not glob.strip():
            raise KvprofError(f"--cache {spec!r}: expected NAME=GLOB, e.g. "
                              "--cache mystore='/data/kv/*.bin'", EX_USAGE)
        rules.append(Rule(name.strip(), glob.strip()))
    return (*rules, *BUILTIN)


def label(path: str, rules: tuple[Rule, ...] = BUILTIN) -> str:
    for r in rules:
        if fnmatchcase(path, r.glob):
            return r.name
    return OTHER
