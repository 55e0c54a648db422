"""What a process is in a serving stack, from its command line: shown instead of a bare pid.

Engines name their processes with setproctitle, which rewrites the command line: vLLM
`VLLM::EngineCore_DP0`, `VLLM::Worker_TP1`, `VLLM::APIServer` (prefix from
VLLM_PROCESS_NAME_PREFIX, see ../shared/reference/engines.md); SGLang `sglang::scheduler_TP0`,
`sglang::detokenizer`. Processes that keep their plain command line are known by what they
run. The vLLM fs tier's disk threads run in EngineCore, not in the GPU workers: the role says
which of the engine's processes did the I/O. First match wins; None: not a known role.
"""
from __future__ import annotations

import re

# (pattern on the command line, role); `\1` takes the engine's own name for the process.
RULES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^VLLM::EngineCore", "vllm EngineCore"),
    (r"^VLLM::Worker", "vllm worker"),
    (r"^VLLM::APIServer", "vllm API server"),
    (r"^VLLM::(\w+?)(?:_\w+)?\b", r"vllm \1"),
    (r"(^|\s|/)vllm\s+serve\b|vllm\.entrypoints", "vllm API server"),
    (r"^sglang::scheduler", "sglang scheduler"),
    (r"^sglang::(\w+?)(?:_TP\d+.*)?$", r"sglang \1"),
    (r"sglang\.launch_server|(^|\s|/)sglang\s+serve\b", "sglang server"),
    (r"lmcache\S*\s.*\bserver\b|lmcache\.\S*server", "lmcache server"),
    (r"text-generation-launcher", "tgi launcher"),
    (r"text-generation-router", "tgi router"),
    (r"text-generation-server", "tgi shard"),
))


def role(cmdline: str) -> str | None:
    """The role of a process with this command line (arguments joined by spaces)."""
    for pattern, name in RULES:
        m = pattern.search(cmdline)
        if m:
            return m.expand(name)
    return None
