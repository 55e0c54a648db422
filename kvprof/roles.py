"""What a process is in a serving stack, from its command line: shown instead of a bare pid.

The engines' roles come with their phase sources (kvprof/phases/registry.py, which says how
each engine names its processes); the others are here. The vLLM fs tier's disk threads run
in EngineCore, not in the GPU workers: the role says which of the engine's processes did the
I/O. First match wins; None: not a known role.
"""
from __future__ import annotations

import re

from kvprof.phases.registry import PHASE_SOURCES

# Processes of the serving stack that no phase source follows: (pattern on the command
# line, role), after the engines' own.
OTHER_ROLES = ((r"lmcache\S*\s.*\bserver\b|lmcache\.\S*server", "lmcache server"),)

RULES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(p), r) for p, r in
    [rule for source in PHASE_SOURCES for rule in source.roles] + list(OTHER_ROLES))


def role(cmdline: str) -> str | None:
    """The role of a process with this command line (arguments joined by spaces)."""
    for pattern, name in RULES:
        m = pattern.search(cmdline)
        if m:
            return m.expand(name)
    return None
