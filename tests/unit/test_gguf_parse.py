"""The GGUF parser against the ``gguf`` package's reader: the same metadata values and tensor
views on the real SmolLM2 file and on files written here; clear errors for bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.unit.test_gguf_io import make_gguf, smollm2_file
from xronos.errors import UserError
from xronos.model.gguf_io import GGUFReader
from xronos.model.gguf_parse import GGUFFile, read_gguf

VT = gguf.GGUFValueType
SCALARS = {  # value type -> a value that uses its range
    VT.UINT8: 250,
    VT.INT8: -120,
    VT.UINT16: 65000,
    VT.INT16: -32000,
    VT.UINT32: 4_000_000_000,
    VT.INT32: -2_000_000_000,
    VT.FLOAT32: 0.1,  # not exact in float32: both readers must give the float32 value
    VT.BOOL: True,
    VT.UINT64: 2**64 - 1,
    VT.INT64: -(2**63),
    VT.FLOAT64: 1e-300,
}
TENSOR_TYPES = ["F32", "F16", "F64", "I8", "I16", "I32", "I64", "BF16", "Q8_0", "Q4_0", "Q4_K"]


def assert_same_as_gguf_package(path: Path) -> GGUFFile:
    """Every metadata value (type included) and every tensor equals the ``gguf`` reader's."""
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path, "r")
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # its header pseudo-fields
    assert list(ours.metadata) == ref_keys
    for key, value in ours.metadata.items():
        want = ref.fields[key].contents()
        assert type(value) is type(want) and value == want, key
        if isinstance(want, list):
            assert [type(v) for v in value] == [type(v) for v in want], key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert t.tensor_type == r.tensor_type and list(t.shape) == r.shape.tolist(), t.name
        assert (t.n_elements, t.n_bytes, t.data_offset) == (r.n_elements, r.n_bytes, r.data_offset)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data, r.data, equal_nan=True), t.name
        assert not t.data.flags.writeable
    return ours


def test_real_smollm2_file_parses_like_the_gguf_package() -> None:
    f = assert_same_as_gguf_package(smollm2_file())
    assert len(f.get("tokenizer.ggml.tokens")) == 49152 and f.get("llama.block_count") == 30
    q = next(t for t in f.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q4_1 and q.shape == (576, 576)
    assert gguf.quants.dequantize(np.asarray(q.data), q.tensor_type).shape == (576, 576)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_exported_files_parse_like_the_gguf_package(tmp_path: Path, dtype: str) -> None:
    path, _, _ = make_gguf(tmp_path, "llama", dtype, tied=False)
    f = assert_same_as_gguf_package(path)
    assert f.get("general.architecture") == "llama" and f.get("absent", 7) == 7


def write_every_kind(path: Path, alignment: int | None = None) -> None:
    """Scalars and arrays of every value type, strings, an array of arrays, and tensors of
    several storage types and ranks (random bytes: the data need not be meaningful)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, value in SCALARS.items():
        w.add_key_value(f"scalar.{vtype.name}", value, vtype)
        w.add_key_value(f"array.{vtype.name}", [value, value, value], VT.ARRAY, sub_type=vtype)
    w.add_key_value("array.BOOL_MIXED", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_string("text", "héllo, 世界\n")
    w.add_array("strings", ["", "a", "ünï", "<|im_end|>", "x" * 1000])
    w.add_key_value("nested", [[1, 2], [3, 4, 5]], VT.ARRAY)
    w.add_key_value("nested.strings", [["a", "bc"], ["d"]], VT.ARRAY)
    for i, name in enumerate(TENSOR_TYPES):
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = [(3, 2, 256), (5, 256), (256,)][i % 3]
        data = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
        w.add_tensor(f"t{i}.{name}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_parses_like_the_gguf_package(
    tmp_path: Path, alignment: int | None
) -> None:
    write_every_kind(tmp_path / "all.gguf", alignment)
    f = assert_same_as_gguf_package(tmp_path / "all.gguf")
    assert f.alignment == (alignment or 32) and f.data_offset % f.alignment == 0
    assert f.get("scalar.FLOAT32") == float(np.float32(0.1)) != 0.1
    assert f.get("scalar.UINT64") == 2**64 - 1 and f.get("array.BOOL_MIXED") == [True, False, True]
    assert f.get("nested") == [1, 2, 3, 4, 5]  # flattened, as the gguf package gives it
    by_name = {t.name: t for t in f.tensors}
    assert by_name["t1.F16"].data.dtype == np.float16 and by_name["t1.F16"].data.shape == (5, 256)
    assert by_name["t7.BF16"].data.dtype == np.uint8  # raw bytes, as for quantized types
    assert by_name["t7.BF16"].data.shape == (5, 512)
    assert by_name["t9.Q4_0"].shape == (256, 2, 3) and by_name["t9.Q4_0"].data.shape == (3, 2, 144)


def test_truncated_files_are_rejected_with_a_clear_message(tmp_path: Path) -> None:
    write_every_kind(tmp_path / "all.gguf")
    whole = (tmp_path / "all.gguf").read_bytes()
    f = read_gguf(tmp_path / "all.gguf")
    data_end = f.tensors[-1].data_offset + f.tensors[-1].n_bytes  # the writer pads past it
    for cut in (30, 100, 400, 1200, f.data_offset - 1, data_end - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="truncated file"):
            read_gguf(path)
        with pytest.raises(UserError, match=r"not a readable GGUF file \(truncated file"):
            GGUFReader(path)


def header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def string(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def kv_u32(key: str, value: int) -> bytes:
    return string(key) + struct.pack("<II", VT.UINT32, value)


def tensor_info(name: str) -> bytes:
    return string(name) + struct.pack("<IQIQ", 1, 4, gguf.GGMLQuantizationType.F32, 0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file"),
        (b"not a gguf file at all" * 10, "not a GGUF file"),
        (header(version=1), "unsupported GGUF version 1"),
        (header(version=4), "unsupported GGUF version 4"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian GGUF files are not supported"),
        (header(n_kv=2) + kv_u32("a", 1) + kv_u32("a", 2), "duplicate metadata key 'a'"),
        (header(n_kv=1) + string("a") + struct.pack("<I", 13), "unknown value type 13"),
        (header(n_kv=1) + kv_u32("general.alignment", 48), "power of two, not 48"),
        (header(n_tensors=2) + tensor_info("w") + tensor_info("w"), "duplicate tensor name 'w'"),
        (header(n_kv=1) + string("a") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 2**40), "trunc"),
    ],
)
def test_bad_files_are_rejected_with_a_clear_message(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    # Zero padding past a non-empty header: the error must come from the fields, not the end.
    path.write_bytes(content + bytes(64) if content else b"")
    with pytest.raises(ValueError, match=message):
        read_gguf(path)
    with pytest.raises(UserError, match=f"not a readable GGUF file .*{message}"):
        GGUFReader(path)


def test_hand_built_file_with_empty_array_and_version_2(tmp_path: Path) -> None:
    """Hand-built bytes (the writer refuses empty arrays): version 2 reads like 3, and the
    tensor's data start at the first multiple of 32 after the infos."""
    body = (
        kv_u32("n", 7)
        + string("empty")
        + struct.pack("<IIQ", VT.ARRAY, VT.INT32, 0)
        + string("general.architecture")
        + struct.pack("<I", VT.STRING)
        + string("llama")
        + tensor_info("w")
    )
    head = header(version=2, n_tensors=1, n_kv=3)
    pad = -(len(head) + len(body)) % 32
    values = np.array([1.5, -2.0, 0.25, 8.0], dtype=np.float32)
    (tmp_path / "v2.gguf").write_bytes(head + body + bytes(pad) + values.tobytes())
    f = assert_same_as_gguf_package(tmp_path / "v2.gguf")
    assert f.version == 2 and f.metadata == {"n": 7, "empty": [], "general.architecture": "llama"}
    assert np.array_equal(f.tensors[0].data, values) and f.data_offset == len(head + body) + pad
