"""The BTF reader against what the kernel states elsewhere: tracefs formats and the uapi."""
from __future__ import annotations

import re
import struct

import pytest

from kvprof import system
from kvprof.capture import btf
from kvprof.errors import EX_UNAVAILABLE, KvprofError

pytestmark = pytest.mark.skipif(not btf.VMLINUX.exists(), reason="the kernel has no BTF")


def test_struct_offsets_equal_what_tracefs_says():
    """Every tracepoint record starts with struct trace_entry; tracefs prints its fields'
    offsets and sizes, BTF describes the same struct."""
    root = system.tracefs()
    if root is None:
        pytest.skip("tracefs is not mounted")
    fmt = (root / "events/block/block_rq_complete/format").read_text()
    fields = {m[1]: (int(m[2]), int(m[3]))
              for m in re.finditer(r"field:.*?(\w+);\s*offset:(\d+);\s*size:(\d+);", fmt)}
    members = btf.vmlinux().members(btf.vmlinux().find(btf.STRUCT, "trace_entry"))
    for name in ("type", "flags", "preempt_count", "pid"):
        m = members[name]
        assert (m.offset, m.size) == fields[f"common_{name}"], name


def test_uapi_layouts_and_numbers():
    b = btf.vmlinux()
    assert b.member("io_uring_cqe", "res").offset == 8  # include/uapi/linux/io_uring.h
    assert b.member("iovec", "iov_len").offset == 8
    ops = b.enum("req_op")
    assert (ops["REQ_OP_READ"], ops["REQ_OP_WRITE"]) == (0, 1)
    assert b.tracepoint_args("block_rq_complete") == ["struct request *", "blk_status_t",
                                                      "unsigned int"]


def test_nested_anonymous_members_are_flattened():
    """struct request keeps fields in anonymous unions; each is found at its absolute offset
    (inside struct request, within its size)."""
    b = btf.vmlinux()
    size = b.size(b.find(btf.STRUCT, "request"))
    members = b.members(b.find(btf.STRUCT, "request"))
    offsets = {n: m.offset for n, m in members.items()}
    assert all(0 <= o < size for o in offsets.values())
    assert len(set(btf.layout_defines(("block", "io_uring")).values())) > 5


def test_a_kernel_with_other_tracepoint_arguments_is_refused(monkeypatch):
    monkeypatch.setitem(btf.TRACEPOINTS["block"], "block_rq_issue",
                        ["struct request *", "int"])
    with pytest.raises(KvprofError) as e:
        btf.layout_defines(("block",))
    assert e.value.exit_code == EX_UNAVAILABLE
    assert "block_rq_issue tracepoint takes (struct request *), not" in str(e.value)


def test_not_btf_is_a_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "vmlinux"
    bad.write_bytes(struct.pack("<HBB", 0x1234, 1, 0) + b"\0" * 64)
    monkeypatch.setattr(btf, "VMLINUX", bad)
    btf.vmlinux.cache_clear()
    try:
        with pytest.raises(KvprofError, match="not BTF data"):
            btf.vmlinux()
        monkeypatch.setattr(btf, "VMLINUX", tmp_path / "absent")
        btf.vmlinux.cache_clear()
        with pytest.raises(KvprofError, match="CONFIG_DEBUG_INFO_BTF"):
            btf.vmlinux()
    finally:
        btf.vmlinux.cache_clear()
