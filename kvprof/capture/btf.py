"""The running kernel's own type layout, read from its BTF (/sys/kernel/btf/vmlinux).

The device probes run on raw tracepoints, which hand over kernel pointers (a struct request,
an io_kiocb): far cheaper per I/O than a formatted record, but the probes must know where each
field sits in this kernel's structs, and installed headers often do not match the running
kernel. So the offsets reach the probes as -D numbers from BTF, and the tracepoints' argument
lists are checked against their `btf_trace_<name>` typedefs (format: include/uapi/linux/btf.h)."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvprof import layers
from kvprof.errors import EX_UNAVAILABLE, KvprofError

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F

INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, \
    FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(1, 20)
MODIFIERS = {TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG}
# Bytes that follow the 12-byte common header: fixed, and per member (times vlen).
EXTRA = {INT: (4, 0), ARRAY: (12, 0), STRUCT: (0, 12), UNION: (0, 12), ENUM: (0, 8),
         FUNC_PROTO: (0, 8), VAR: (4, 0), DATASEC: (0, 12), DECL_TAG: (4, 0), ENUM64: (0, 12)}


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # bytes from the start of the outermost struct
    size: int    # bytes; 0 for a bitfield (not readable as a whole)
    type_id: int


class Btf:
    def __init__(self, data: bytes):
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = \
            struct.unpack_from("<HBBIIIII", data, 0)
        if magic != MAGIC or version != 1:
            raise ValueError("not BTF data")
        self._data = data
        self._types_at = hdr_len + type_off
        self._strs = data[hdr_len + str_off: hdr_len + str_off + str_len]
        # Type ids start at 1; offsets[i] is where type i's record starts.
        self._offsets = [0]
        self._by_name: dict[tuple[int, str], int] = {}
        pos, end = self._types_at, self._types_at + type_len
        while pos < end:
            name_off, info, _ = struct.unpack_from("<III", data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if kind in (STRUCT, UNION, ENUM, ENUM64, TYPEDEF, FUNC_PROTO) and name_off:
                self._by_name.setdefault((kind, self._str(name_off)), len(self._offsets))
            self._offsets.append(pos)
            fixed, per = EXTRA.get(kind, (0, 0))
            pos += 12 + fixed + per * vlen

    def _str(self, off: int) -> str:
        return self._strs[off: self._strs.index(b"\0", off)].decode()

    def _head(self, tid: int) -> tuple[int, int, int, int, int]:
        """(kind, vlen, kind_flag, size_or_type, record position) of a type."""
        pos = self._offsets[tid]
        name_off, info, size_or_type = struct.unpack_from("<III", self._data, pos)
        return (info >> 24) & 0x1F, info & 0xFFFF, info >> 31, size_or_type, pos

    def find(self, kind: int, name: str) -> int:
        tid = self._by_name.get((kind, name))
        if tid is None:
            raise KeyError(name)
        return tid

    def resolve(self, tid: int) -> int:
        """Through typedefs and modifiers to the type itself."""
        while True:
            kind, _, _, ref, _ = self._head(tid)
            if kind not in MODIFIERS:
                return tid
            tid = ref

    def size(self, tid: int) -> int:
        tid = self.resolve(tid)
        kind, _, _, size, pos = self._head(tid)
        if kind == PTR:
            return 8
        if kind == ARRAY:
            elem, _, nelems = struct.unpack_from("<III", self._data, pos + 12)
            return self.size(elem) * nelems
        return size

    def members(self, tid: int, base: int = 0) -> dict[str, Member]:
        """A struct's or union's members by name, anonymous ones flattened in."""
        kind, vlen, kflag, _, pos = self._head(self.resolve(tid))
        if kind not in (STRUCT, UNION):
            raise KeyError("not a struct")
        out: dict[str, Member] = {}
        for i in range(vlen):
            name_off, mtype, off = struct.unpack_from("<III", self._data, pos + 12 + 12 * i)
            bitfield = kflag and off >> 24
            bits = off & 0xFFFFFF if kflag else off
            at = base + bits // 8
            if not name_off:
                out.update(self.members(mtype, at))
                continue
            out.setdefault(self._str(name_off),
                           Member(self._str(name_off), at,
                                  0 if bitfield or bits % 8 else self.size(mtype), mtype))
        return out

    def member(self, struct_name: str, path: str) -> Member:
        tid = self.find(STRUCT, struct_name)
        return self.members(tid)[path]

    def enum(self, name: str) -> dict[str, int]:
        for kind, step in ((ENUM, 8), (ENUM64, 12)):
            tid = self._by_name.get((kind, name))
            if tid is None:
                continue
            _, vlen, _, _, pos = self._head(tid)
            out = {}
            for i in range(vlen):
                name_off, lo = struct.unpack_from("<Ii", self._data, pos + 12 + step * i)
                if kind == ENUM64:
                    lo |= struct.unpack_from("<I", self._data, pos + 20 + step * i)[0] << 32
                out[self._str(name_off)] = lo
            return out
        raise KeyError(name)

    def tracepoint_args(self, name: str) -> list[str]:
        """The C type names of a raw tracepoint's arguments, from its btf_trace_<name>
        typedef (a pointer to a function whose first parameter is the probe's data)."""
        tid = self.find(TYPEDEF, f"btf_trace_{name}")
        kind, _, _, ref, _ = self._head(self.resolve(tid))
        if kind != PTR:
            raise KeyError(name)
        kind, vlen, _, _, pos = self._head(self.resolve(ref))
        if kind != FUNC_PROTO:
            raise KeyError(name)
        params = [struct.unpack_from("<II", self._data, pos + 12 + 8 * i)[1] for i in range(vlen)]
        return [self.type_name(t) for t in params[1:]]

    def type_name(self, tid: int) -> str:
        kind, _, _, ref, pos = self._head(tid)
        name_off = struct.unpack_from("<I", self._data, pos)[0]
        if kind == PTR:
            return (self.type_name(ref) if ref else "void") + " *"
        if kind in (CONST, VOLATILE, RESTRICT, TYPE_TAG):
            return self.type_name(ref)
        prefix = {STRUCT: "struct ", UNION: "union ", ENUM: "enum "}.get(kind, "")
        return prefix + (self._str(name_off) if name_off else "?")


@lru_cache(maxsize=1)
def vmlinux() -> Btf:
    try:
        return Btf(VMLINUX.read_bytes())
    except OSError as e:
        raise KvprofError(f"the kernel's BTF ({VMLINUX}) cannot be read: {e.strerror}; kvprof's "
                          "device probes need a kernel built with CONFIG_DEBUG_INFO_BTF=y "
                          "(every major distribution since 2020)", EX_UNAVAILABLE) from None
    except ValueError as e:
        raise KvprofError(f"{VMLINUX}: {e}", EX_UNAVAILABLE) from None


# Per layer (kvprof/layers.py), only those with raw tracepoints: the raw tracepoints its
# probe attaches to with the arguments they read, as BTF names them (lists, as
# tracepoint_args returns them).
TRACEPOINTS = {layer.name: {tp: list(args) for tp, args in layer.raw_args.items()}
               for layer in layers.LAYERS if layer.raw_args}
# -D name: (struct, member) whose byte offset it carries.
FIELDS = {layer.name: dict(layer.fields) for layer in layers.LAYERS if layer.fields}
# -D name: (enum, enumerator) whose value it carries.
ENUMS = {layer.name: dict(layer.enums) for layer in layers.LAYERS if layer.enums}


def layout_defines(layers: tuple[str, ...], btf: Btf | None = None) -> dict[str, int]:
    """The -D values the device probes of `layers` need, from this kernel's BTF; a kernel
    whose tracepoints or structs differ from what the probes read is refused here, with the
    difference named, rather than traced wrongly."""
    wanted = [layer for layer in layers if layer in TRACEPOINTS]
    if not wanted:
        return {}
    btf = btf or vmlinux()
    out: dict[str, int] = {}
    for layer in wanted:
        for tp, args in TRACEPOINTS[layer].items():
            try:
                got = btf.tracepoint_args(tp)
            except KeyError:
                raise _unsupported(f"it has no {tp} tracepoint") from None
            if got != args:
                raise _unsupported(f"its {tp} tracepoint takes ({', '.join(got)}), "
                                   f"not ({', '.join(args)})")
        for name, (struct_name, member) in FIELDS.get(layer, {}).items():
            try:
                m = btf.member(struct_name, member)
            except KeyError:
                raise _unsupported(f"its struct {struct_name} has no {member}") from None
            if not m.size:
                raise _unsupported(f"struct {struct_name}.{member} is a bitfield")
            out[name] = m.offset
        for name, (enum_name, enumerator) in ENUMS.get(layer, {}).items():
            try:
                out[name] = btf.enum(enum_name)[enumerator]
            except KeyError:
                raise _unsupported(f"its enum {enum_name} has no {enumerator}") from None
    return out


def _unsupported(why: str) -> KvprofError:
    return KvprofError(f"this kernel's block/io_uring layout is not one kvprof knows: {why} "
                       "(kvprof's device probes follow Linux 6.x)", EX_UNAVAILABLE)
