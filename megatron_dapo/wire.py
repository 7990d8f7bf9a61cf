"""A data-only encoding for everything that crosses between ranks: the job store (the rollout queue's group
summaries, the split launch's mailbox), the rollout exchange (all_gather / all_to_all over gloo) and the weight
channel's bucket headers. Nothing here is pickle: decoding builds only plain values, tensors and the record types
registered below, so a value written by anyone who reaches a store's port or a socket cannot run code.

    dumps(obj) -> bytes      None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor (CPU; its dtype
                             from DTYPES), torch.dtype, and registered enums and dataclasses (`record`)
    loads(data) -> obj       WireError (one line) for anything else: an unknown tag or type name, a field the record
                             does not have, a size past the end, nesting deeper than MAX_DEPTH

Format: b"MDW1", then one tagged value. Tags (one byte): N none, T true, F false, i int64, J big int (decimal), f
float64, s str (u32 length, UTF-8), b bytes (u64 length), l list / t tuple (u32 count, items), d dict (u32 count,
key and value pairs), x tensor (dtype name, u8 ndim, u64 dims, raw little-endian bytes), y torch.dtype (its name), e
enum (registered type name, value), c record (registered type name, u32 field count, (field name, value) pairs; the
record is built by calling its class with those keyword arguments). Integers are little-endian.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import torch

from megatron_dapo.errors import first_line

MAGIC = b"MDW1"
MAX_DEPTH = 64
"""Deepest nesting a message may have (our records nest a handful of levels)."""

DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
    )
}  # fmt: skip
"""Tensor dtypes that may cross, by name."""

_RECORDS: dict[str, type] = {}


class WireError(ValueError):
    """A value that cannot be encoded, or bytes that are not a message of this encoding."""


def record(cls: type) -> type:
    """Register a dataclass or an Enum as a type that may cross between ranks (a class decorator; the name is the
    class's module and qualified name, the same in every process of the job)."""
    if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise TypeError(f"wire.record: {cls!r} is neither a dataclass nor an Enum")
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _RECORDS.get(name, cls) is not cls:
        raise TypeError(f"wire.record: {name} is already registered")
    _RECORDS[name] = cls
    return cls


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------------------------
def dumps(obj: Any) -> bytes:
    """`obj` as bytes of this encoding (see the module docstring); WireError names what cannot cross."""
    out = bytearray(MAGIC)
    _encode(obj, out, 0)
    return bytes(out)


def _str(text: str, out: bytearray) -> None:
    raw = text.encode("utf-8")
    out += struct.pack("<I", len(raw))
    out += raw


def _encode(obj: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise WireError(f"wire: nesting deeper than {MAX_DEPTH}")
    if obj is None:
        out += b"N"
    elif obj is True or obj is False:
        out += b"T" if obj else b"F"
    elif isinstance(obj, enum.Enum):
        _encode_enum(obj, out, depth)
    elif isinstance(obj, int):
        if -(2**63) <= obj < 2**63:
            out += b"i" + struct.pack("<q", obj)
        else:
            out += b"J"
            _str(str(obj), out)
    elif isinstance(obj, float):
        out += b"f" + struct.pack("<d", obj)
    elif isinstance(obj, str):
        out += b"s"
        _str(obj, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        raw = bytes(obj)
        out += b"b" + struct.pack("<Q", len(raw))
        out += raw
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        out += (b"l" if type(obj) is list else b"t") + struct.pack("<I", len(obj))
        for item in obj:
            _encode(item, out, depth + 1)
    elif type(obj) is dict:
        out += b"d" + struct.pack("<I", len(obj))
        for key, value in obj.items():
            _encode(key, out, depth + 1)
            _encode(value, out, depth + 1)
    elif isinstance(obj, torch.Tensor):
        _encode_tensor(obj, out)
    elif isinstance(obj, torch.dtype):
        out += b"y"
        _str(_dtype_name(obj), out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _encode_record(obj, out, depth)
    else:
        raise WireError(f"wire: a {type(obj).__qualname__} cannot cross between ranks (not a registered type)")


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise WireError(f"wire: tensors of {dtype} cannot cross (dtypes: {', '.join(DTYPES)})")
    return name


def _encode_tensor(t: torch.Tensor, out: bytearray) -> None:
    name = _dtype_name(t.dtype)
    t = t.detach().cpu().contiguous()
    out += b"x"
    _str(name, out)
    out += struct.pack("<B", t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    out += struct.pack("<Q", len(raw))
    out += raw


def _registered(cls: type) -> str:
    name = _name(cls)
    if _RECORDS.get(name) is not cls:
        raise WireError(f"wire: a {cls.__qualname__} cannot cross between ranks (not a registered type)")
    return name


def _encode_enum(obj: enum.Enum, out: bytearray, depth: int) -> None:
    out += b"e"
    _str(_registered(type(obj)), out)
    _encode(obj.value, out, depth + 1)


def _encode_record(obj: Any, out: bytearray, depth: int) -> None:
    out += b"c"
    _str(_registered(type(obj)), out)
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    out += struct.pack("<I", len(names))
    for name in names:
        _str(name, out)
        _encode(getattr(obj, name), out, depth + 1)


# ---------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------
def loads(data: bytes | bytearray | memoryview) -> Any:
    """The value `dumps` encoded; WireError (one line) for bytes that are not exactly one message."""
    view = memoryview(bytes(data))
    if view[: len(MAGIC)] != MAGIC:
        raise WireError("wire: not a message of this encoding (no MDW1 header)")
    reader = _Reader(view, len(MAGIC))
    value = reader.value(0)
    if reader.pos != len(view):
        raise WireError(f"wire: {len(view) - reader.pos} bytes after the end of the message")
    return value


def load_stored(data: bytes, what: str) -> Any:
    """`loads` of a value read from a store (the job's or the launch's TCPStore, reachable by whoever reaches its
    port): a value that is not a message of this job ends the job with one line (JobError) naming `what`."""
    from megatron_dapo.errors import JobError

    try:
        return loads(data)
    except WireError as err:
        raise JobError(f"{what} is not a message of this job ({err}); another process wrote to the store") from None


def all_gather_values(value: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's `value` (this module's types) in rank order, on every rank of `group` (a gloo group of world_size
    ranks; collective): all_gather_object without pickle. Each value is encoded (dumps), the sizes all-gathered,
    then the bytes padded to the longest; RuntimeError from the group (its timeout) propagates."""
    import torch.distributed as dist

    blob = dumps(value)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(blob)], dtype=torch.int64), group=group)
    width = max(int(s) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    parts = [torch.empty(width, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(parts, mine, group=group)
    return [loads(part[: int(size)].numpy().tobytes()) for part, size in zip(parts, sizes, strict=True)]


def stored_int(data: bytes, what: str) -> int:
    """A number a rank keeps on a store as decimal text (a `Store.add` counter, a version it `set`): anything else
    ends the job with one line (JobError) naming `what`, as `load_stored` does."""
    from megatron_dapo.errors import JobError

    text = bytes(data).decode("ascii", "replace")
    digits = text[1:] if text.startswith("-") else text
    if not (0 < len(digits) <= 19 and digits.isdigit() and digits.isascii()):
        raise JobError(f"{what} is not a message of this job (not a number: {text[:40]!r}); another process wrote to "
                       "the store")  # fmt: skip
    return int(text)


class _Reader:
    def __init__(self, view: memoryview, pos: int) -> None:
        self.view, self.pos = view, pos

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise WireError("wire: a size runs past the end of the message")
        part = self.view[self.pos : self.pos + n]
        self.pos += n
        return part

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def text(self) -> str:
        try:
            return str(self.take(self.unpack("<I")), "utf-8")
        except UnicodeDecodeError:
            raise WireError("wire: a string is not UTF-8") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"wire: nesting deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        simple = {b"N": None, b"T": True, b"F": False}
        if tag in simple:
            return simple[tag]
        if tag == b"i":
            return self.unpack("<q")
        if tag == b"J":
            text = self.text()
            if not text.lstrip("-").isdigit() or len(text) > 4300:
                raise WireError("wire: a big integer is not one")
            return int(text)
        if tag == b"f":
            return self.unpack("<d")
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return bytes(self.take(self.unpack("<Q")))
        if tag in (b"l", b"t"):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return items if tag == b"l" else tuple(items)
        if tag == b"d":
            return self.mapping(depth)
        if tag == b"x":
            return self.tensor()
        if tag == b"y":
            return self.dtype()
        if tag == b"e":
            cls = self.registered(enum.Enum)
            try:
                return cls(self.value(depth + 1))
            except ValueError:
                raise WireError(f"wire: not a value of {cls.__qualname__}") from None
        if tag == b"c":
            return self.record(depth)
        raise WireError(f"wire: unknown tag {tag!r}")

    def count(self) -> int:
        n = self.unpack("<I")
        if n > len(self.view) - self.pos:  # every item takes at least one byte
            raise WireError("wire: a count runs past the end of the message")
        return n

    def mapping(self, depth: int) -> dict:
        out = {}
        for _ in range(self.count()):
            key = self.value(depth + 1)
            try:
                out[key] = self.value(depth + 1)
            except TypeError:
                raise WireError(f"wire: a dict key of type {type(key).__qualname__}") from None
        return out

    def dtype(self) -> torch.dtype:
        name = self.text()
        if name not in DTYPES:
            raise WireError(f"wire: dtype {name!r} cannot cross (dtypes: {', '.join(DTYPES)})")
        return DTYPES[name]

    def tensor(self) -> torch.Tensor:
        dtype = self.dtype()
        shape = [self.unpack("<Q") for _ in range(self.unpack("<B"))]
        raw = self.take(self.unpack("<Q"))
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(raw) != numel * itemsize:
            raise WireError(f"wire: a tensor of shape {shape} and {dtype} with {len(raw)} bytes")
        if not numel:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def registered(self, kind: type) -> type:
        name = self.text()
        cls = _RECORDS.get(name)
        if cls is None or (kind is enum.Enum) != issubclass(cls, enum.Enum):
            raise WireError(f"wire: {name!r} is not a type that may cross between ranks")
        return cls

    def record(self, depth: int) -> Any:
        cls = self.registered(object)
        allowed = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for _ in range(self.count()):
            name = self.text()
            if name not in allowed or name in kwargs:
                raise WireError(f"wire: {cls.__qualname__} has no field {name!r} (or it came twice)")
            kwargs[name] = self.value(depth + 1)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as err:  # a missing field, or a value the record refuses
            raise WireError(f"wire: {cls.__qualname__}: {first_line(err)}") from None
