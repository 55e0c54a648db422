"""numpy's copies of the probes' structs and codes are held to the compiled C at load: the
real probes pass, and a copy of them with two same-size fields swapped, or a code renumbered,
is refused in one line before any data is read."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from kvprof.capture import ebpf
from kvprof.capture.layout import check_struct
from kvprof.errors import EX_SOFTWARE, KvprofError
from tests.helpers import live

SOURCE_LAYERS = ("block", "io_uring", "syscall", "tcp")  # gds needs libcufile


def _probes_with(monkeypatch, tmp_path, old: str, new: str):
    """Capture from here on builds its C from a copy of kvprof/layers/ with `old` replaced in
    kvprof.h, through the same seam as the real probes (ebpf.probe_dir)."""
    copy = tmp_path / "layers"
    shutil.copytree(ebpf.probe_dir(), copy)
    header = copy / ebpf.HEADER
    text = header.read_text()
    assert text.count(old) == 1, f"{old!r} is no longer in kvprof.h: update this test"
    header.write_text(text.replace(old, new))
    monkeypatch.setattr(ebpf, "probe_dir", lambda: copy)


@live
def test_the_real_probes_load_and_pass_the_check():
    cap = ebpf.Capture(SOURCE_LAYERS, ebpf.CaptureFilter())
    cap.stop()


@live
def test_two_same_size_fields_swapped_in_the_c_fail_at_load(monkeypatch, tmp_path, capsys):
    _probes_with(monkeypatch, tmp_path, "    u32 dev;\n    u32 pid;\n",
                 "    u32 pid;\n    u32 dev;\n")
    with pytest.raises(KvprofError) as e:
        ebpf.Capture(("block",), ebpf.CaptureFilter())
    with capsys.disabled():
        print(f"\nswapped dev and pid in struct kvprof_io: kvprof: {e.value}")
    assert e.value.exit_code == EX_SOFTWARE
    assert str(e.value) == ("kvprof/layers/kvprof.h struct kvprof_io: field 'dev' at offset 56 in "
                            "the C, 52 in kvprof/capture/ebpf.py")


@live
@pytest.mark.parametrize("old, new, message", [
    ("#define KVPROF_LOST_RINGBUF 0\n#define KVPROF_LOST_BLOCK_UNMATCHED 1\n",
     "#define KVPROF_LOST_RINGBUF 1\n#define KVPROF_LOST_BLOCK_UNMATCHED 0\n",
     "kvprof/layers/kvprof.h KVPROF_LOST_RINGBUF is 1 in the C, 0 in kvprof/capture/ebpf.py"),
    ("#define KVPROF_LAYER_WRITEBACK 7\n",
     "#define KVPROF_LAYER_WRITEBACK 7\n#define KVPROF_LAYER_TOY 5\n",
     "kvprof/layers/kvprof.h KVPROF_LAYER_TOY = 5 has no counterpart in kvprof"),
    ("#define KVPROF_OP_DISCARD 4\n",
     "#define KVPROF_OP_DISCARD 4\n#define KVPROF_OP_WRITE_ZEROES 5\n",
     "kvprof/layers/kvprof.h KVPROF_OP_WRITE_ZEROES = 5 has no counterpart in kvprof"),
], ids=["counter-renumbered", "layer-added-in-c-only", "op-added-in-c-only"])
def test_a_code_changed_in_the_c_alone_fails_at_load(monkeypatch, tmp_path, capsys, old, new,
                                                    message):
    _probes_with(monkeypatch, tmp_path, old, new)
    with pytest.raises(KvprofError) as e:
        ebpf.Capture(SOURCE_LAYERS, ebpf.CaptureFilter())
    with capsys.disabled():
        print(f"\nkvprof: {e.value}")
    assert e.value.exit_code == EX_SOFTWARE and str(e.value) == message


class _Record(ctypes.Structure):
    # As bcc would build it from `struct rec { u64 ts; s32 err; u16 flags; u8 pad[2]; }`.
    _fields_ = [("ts", ctypes.c_uint64), ("err", ctypes.c_int32), ("flags", ctypes.c_uint16),
                ("pad", ctypes.c_uint8 * 2)]


@pytest.mark.parametrize("fields, message", [
    ([("ts", "<u8"), ("err", "<i4"), ("flags", "<u2"), ("pad", "V2")], None),
    ([("ts", "<u8"), ("err", "<u4"), ("flags", "<u2"), ("pad", "V2")],
     "field 'err' holds int32 in the C, uint32 in x.py"),
    ([("ts", "<u8"), ("err", "<i4"), ("flags", "<u2")],
     "field 'pad' of the C is not in x.py"),
    ([("ts", "<u8"), ("err", "<i4"), ("flags", "<u4")],
     "field 'flags' is 2 bytes in the C, 4 in x.py"),
])
def test_fields_are_compared_by_kind_and_size_not_only_offset(fields, message):
    """Without root: the comparison itself, on a type like those bcc builds."""
    py = np.dtype(fields)
    if message is None:
        check_struct(np.dtype(_Record), py, "rec", "r.h", "x.py")
        return
    with pytest.raises(KvprofError) as e:
        check_struct(np.dtype(_Record), py, "rec", "r.h", "x.py")
    assert str(e.value) == f"r.h struct rec: {message}"
