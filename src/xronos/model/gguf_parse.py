"""A fast, read-only parser of GGUF files: metadata, tensor infos and memory-mapped tensor data.

A GGUF file is a little-endian header (magic ``GGUF``, version, tensor count, metadata count),
the metadata key/value pairs, one info record per tensor (name, dims, GGML type, offset), then
padding up to ``general.alignment`` (32 by default) and the tensor data. Tensor offsets are
relative to the start of that data.

:func:`read_gguf` reads the header fields with ``struct.unpack_from`` straight from a read-only
``mmap`` and turns numeric arrays into Python lists with one ``np.frombuffer`` each, so a
49k-token vocabulary costs a few tens of milliseconds. Metadata values are what the ``gguf``
package's ``ReaderField.contents()`` returns (``str``, Python ``int``/``float``/``bool``, or a
flat list of them); tensor ``data`` are views of the mapped file with the dtype and shape its
``GGUFReader`` gives, ready for ``gguf.quants.dequantize``. Versions 2 and 3 are read;
big-endian files are not supported.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value type codes of the GGUF format.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)

#: Fixed-size scalar type -> little-endian struct format and numpy dtype.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype[Any]]] = {
    code: (struct.Struct("<" + fmt), np.dtype("<" + fmt))
    for code, fmt in (
        (_UINT8, "B"),
        (_INT8, "b"),
        (_UINT16, "H"),
        (_INT16, "h"),
        (_UINT32, "I"),
        (_INT32, "i"),
        (_FLOAT32, "f"),
        (_BOOL, "B"),  # read as a byte, turned into bool below
        (_UINT64, "Q"),
        (_INT64, "q"),
        (_FLOAT64, "d"),
    )
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count

#: GGML types whose data the ``gguf`` package exposes as typed elements (others as raw bytes).
_TYPED: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: the GGUF name (``blk.0.attn_q.weight``).
        tensor_type: its GGML storage type.
        shape: dims in GGML order, fastest-varying first (``[in, out]`` for a matrix).
        n_elements: the product of ``shape``.
        n_bytes: the size of its data in the file.
        data_offset: where its data starts, from the start of the file.
        data: a read-only view of the mapped file: typed elements of shape ``shape[::-1]`` for
            F16/F32/F64/I8/I16/I32/I64, raw bytes (one row of blocks per GGML row) otherwise.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The parsed contents of a GGUF file; tensor data stay in the memory map."""

    path: Path
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key``, or ``default`` if the file has none."""
        return self.metadata.get(key, default)


class _Cursor:
    """Reads little-endian values one after another from a buffer, failing cleanly at its end."""

    def __init__(self, buf: mmap.mmap, pos: int = 0) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = pos

    def require(self, n: int, what: str) -> None:
        """ValueError unless ``n`` more bytes follow (checked before trusting a count)."""
        if self.pos + n > self.size:
            raise ValueError(f"truncated file: {what} at byte {self.pos} runs past the end")

    def take(self, n: int, what: str) -> int:
        """Start of the next ``n`` bytes, and advance past them."""
        self.require(n, what)
        self.pos += n
        return self.pos - n

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack(_U64, what)
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} at byte {start} is not valid UTF-8") from e

    def value(self, vtype: int, what: str) -> Any:
        """One metadata value of type code ``vtype``, as a Python object."""
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item_type = self.unpack(_U32, what)
            count = self.unpack(_U64, what)
            return self.array(item_type, count, what)
        if vtype not in _SCALARS:
            raise ValueError(f"{what}: unknown value type {vtype}")
        value = self.unpack(_SCALARS[vtype][0], what)
        return bool(value) if vtype == _BOOL else value

    def array(self, item_type: int, count: int, what: str) -> list[Any]:
        if item_type in _SCALARS:  # fixed-size items: one numpy read for the whole array
            dtype = _SCALARS[item_type][1]
            start = self.take(count * dtype.itemsize, what)
            items = np.frombuffer(self.buf, dtype, count, start)
            return (items != 0 if item_type == _BOOL else items).tolist()  # type: ignore[no-any-return]
        if item_type == _STRING:
            return self.strings(count, what)
        if item_type != _ARRAY:
            raise ValueError(f"{what}: unknown array item type {item_type}")
        # An array of arrays (rare) comes out flattened, as the gguf package's contents() gives.
        self.require(count * 12, what)  # each item is at least its 12-byte header
        out: list[Any] = []
        for _ in range(count):
            out.extend(self.value(_ARRAY, what))
        return out

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings; a tight loop, since vocabularies hold 10⁴–10⁵ of them."""
        self.require(8 * count, what)  # each string is at least its 8-byte length
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                if pos + n > size:
                    raise ValueError(f"truncated file: {what} at byte {pos} runs past the end")
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except struct.error as e:
            raise ValueError(f"truncated file: {what} at byte {pos} runs past the end") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{what}: item {len(out)} is not valid UTF-8") from e
        self.pos = pos
        return out


def _header(buf: mmap.mmap) -> tuple[int, int, int]:
    """Version, tensor count and metadata count; ValueError for anything but GGUF v2/v3 LE."""
    if len(buf) < _HEADER.size or buf[:4] != GGUF_MAGIC:
        raise ValueError("not a GGUF file (no 'GGUF' magic at the start)")
    _, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(buf[4:8], "big") in SUPPORTED_VERSIONS:  # the whole file is swapped
            raise ValueError("big-endian GGUF files are not supported")
        supported = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise ValueError(f"unsupported GGUF version {version} (supported: {supported})")
    return version, n_tensors, n_kv


def _alignment(metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ValueError(f"general.alignment must be a power of two, not {value!r}")
    return value


def _tensor(buf: mmap.mmap, info: tuple[str, tuple[int, ...], int, int], base: int) -> GGUFTensor:
    """A tensor from its info record (``name, dims, type code, offset``) and the data start."""
    name, dims, type_code, rel_offset = info
    try:
        ttype = GGMLQuantizationType(type_code)
        block, type_size = GGML_QUANT_SIZES[ttype]
    except (ValueError, KeyError) as e:
        raise ValueError(f"tensor {name!r}: unknown GGML type {type_code}") from e
    n_elements = math.prod(dims)  # Python ints: absurd dims fail the size check, not overflow
    n_bytes = n_elements * type_size // block
    offset = base + rel_offset
    if offset + n_bytes > len(buf):
        raise ValueError(f"truncated file: data of tensor {name!r} runs past the end")
    np_shape = tuple(reversed(dims))  # numpy order: slowest-varying first
    if ttype in _TYPED:
        data = np.frombuffer(buf, _TYPED[ttype], n_elements, offset).reshape(np_shape)
    else:
        try:
            byte_shape = quant_shape_to_byte_shape(np_shape, ttype)
        except ValueError as e:  # rows that are not whole blocks
            raise ValueError(f"tensor {name!r}: {e}") from e
        data = np.frombuffer(buf, np.uint8, n_bytes, offset).reshape(byte_shape)
    return GGUFTensor(name, ttype, dims, n_elements, n_bytes, offset, data)


def parse_gguf(buf: mmap.mmap, path: Path) -> GGUFFile:
    """Parse a GGUF file already mapped into ``buf`` (see :func:`read_gguf`)."""
    version, n_tensors, n_kv = _header(buf)
    cur = _Cursor(buf, _HEADER.size)
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise ValueError(f"duplicate metadata key {key!r}")
        vtype = cur.unpack(_U32, f"metadata {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r}")
        names.add(name)
        what = f"tensor info {name!r}"
        n_dims = cur.unpack(_U32, what)
        start = cur.take(8 * n_dims, what)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, start)
        type_code = cur.unpack(_U32, what)
        infos.append((name, dims, type_code, cur.unpack(_U64, what)))
    alignment = _alignment(metadata)
    base = -(-cur.pos // alignment) * alignment  # data start: next multiple of the alignment
    tensors = [_tensor(buf, info, base) for info in infos]
    return GGUFFile(path, version, alignment, base, metadata, tensors)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at ``path``; its tensor data are read-only views of a memory map.

    Raises:
        ValueError: not a GGUF file, an unsupported version or byte order, a truncated file,
            a duplicate key or tensor name, or an invalid value.
        OSError: the file cannot be opened.
    """
    path = Path(path)
    with path.open("rb") as f:
        if path.stat().st_size < _HEADER.size:
            raise ValueError("not a GGUF file (shorter than a GGUF header)")
        # The map outlives the file object; the tensor views keep it alive.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return parse_gguf(buf, path)
