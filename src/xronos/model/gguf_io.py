"""Reading GGUF checkpoints (llama.cpp / ollama files) slice by slice, in Hugging Face terms.

:class:`GGUFReader` has the interface of :class:`~xronos.model.safetensors_io.SafetensorsReader`:
tensors are named and laid out as in a Hugging Face checkpoint (``model.layers.0.self_attn.
q_proj.weight``, ``[out, in]``), and ``read(name, dim, start, end)`` materialises only the
requested slice. The file is memory-mapped; a GGUF row is one output row of the Hugging Face
matrix and is quantized on its own (in blocks of 32 or 256 columns), so a slice along ``dim=0``
dequantizes only its rows and a slice along ``dim=1`` only the blocks that cover its columns.

llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` for the ``llama`` architecture
(rotary pairs interleaved instead of split in halves); the reader undoes it. ``qwen2``/``qwen3``
files are not permuted. :func:`config_from_gguf` turns the file's metadata into a
``config.json``-style dict that :meth:`xronos.config.ModelConfig.from_hf_dict` accepts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import TracebackType
from typing import Any

import gguf
import numpy as np
import torch

from xronos.errors import UserError
from xronos.model.gguf_parse import GGUFFile, GGUFTensor, read_gguf

#: GGUF ``general.architecture`` -> Hugging Face architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: Hugging Face architecture -> GGUF ``general.architecture`` (Mistral is ``llama`` in GGUF).
HF_TO_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
#: Architectures whose q/k rows llama.cpp permutes.
PERMUTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL_NAMES.items()}
_LAYER_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"


def hf_to_gguf_name(name: str) -> str | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``; None if unknown."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.ffn_up.weight`` -> ``model.layers.3.mlp.up_proj.weight``; None if unknown."""
    if name in _GLOBAL_BACK:
        return _GLOBAL_BACK[name]
    m = _GGUF_LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_BACK:
        return f"model.layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"
    return None


def qk_row_index(rows: int, n_head: int) -> np.ndarray:
    """Where llama.cpp puts each Hugging Face row of a permuted q/k projection.

    Hugging Face keeps the two halves of each head's rotary pairs apart (rows ``i`` and
    ``i + d/2``); llama.cpp interleaves them (rows ``2i`` and ``2i + 1``). Returns ``idx`` of
    shape ``[rows]`` with ``gguf[idx[r]] == hf[r]``, so ``hf = gguf[idx]``.
    """
    d = rows // n_head
    if d * n_head != rows or d % 2:
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even width")
    r = np.arange(rows)
    head, within = np.divmod(r, d)
    half, i = np.divmod(within, d // 2)
    return head * d + 2 * i + half  # type: ignore[no-any-return]


def permute_qk(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face layout -> llama.cpp layout of a q/k weight ``[rows, in]`` or bias ``[rows]``."""
    idx = torch.from_numpy(qk_row_index(t.shape[0], n_head))
    out = torch.empty_like(t)
    out[idx] = t
    return out


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.get(key, default)
    return list(value) if isinstance(value, list) else value  # a copy, as callers may edit it


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(x)))


class GGUFReader:
    """Hugging Face name -> tensor (or slice of it) over one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bytes_read = 0
        if not self.path.is_file():
            raise UserError(f"{self.path}: no such GGUF file")
        try:
            self._reader: GGUFFile | None = read_gguf(self.path)
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.arch = str(_field(self._reader, "general.architecture", ""))
        if self.arch not in GGUF_ARCHITECTURES:
            raise UserError(
                f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)}"
            )
        self._tensors: dict[str, GGUFTensor] = {}
        self._extra: dict[str, GGUFTensor] = {}
        for t in self._reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
            else:
                self._extra[t.name] = t
        n_head = int(_field(self._reader, f"{self.arch}.attention.head_count", 0))
        n_kv = int(_field(self._reader, f"{self.arch}.attention.head_count_kv", n_head))
        self._heads = {"q_proj": n_head, "k_proj": n_kv}

    # -- names and shapes ----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        """Hugging Face names of every tensor in the file (``lm_head.weight`` only if untied)."""
        return list(self._tensors)

    def shape(self, name: str) -> list[int]:
        """Hugging Face shape (``[out, in]`` for a matrix) of tensor ``name``."""
        return [int(n) for n in reversed(self._tensor(name).shape)]

    def tensor_type(self, name: str) -> str:
        """The GGML storage type of ``name`` (``F32``, ``Q8_0``, ``Q4_K``, ...)."""
        return str(self._tensor(name).tensor_type.name)

    def _tensor(self, name: str) -> GGUFTensor:
        if self._reader is None:
            raise ValueError("GGUFReader is closed")
        if name not in self._tensors:
            raise UserError(f"{self.path}: tensor {name!r} missing from the GGUF file")
        return self._tensors[name]

    def _row_index(self, name: str, rows: int) -> np.ndarray | None:
        if self.arch not in PERMUTED_ARCHS:
            return None
        proj = name.rsplit(".", 2)[-2]
        return qk_row_index(rows, self._heads[proj]) if proj in self._heads else None

    # -- reading -------------------------------------------------------------------------
    def read(
        self, name: str, dim: int | None = None, start: int | None = None, end: int | None = None
    ) -> torch.Tensor:
        """The whole tensor, or elements ``[start, end)`` along ``dim``, as float32.

        Args:
            name: Hugging Face tensor name.
            dim: None for the whole tensor; 0 (rows, ``out``) or 1 (columns, ``in``).
            start, end: the range along ``dim``; None means 0 / the full length.
        Returns:
            ``[end - start, in]`` for ``dim=0``, ``[out, end - start]`` for ``dim=1`` (a 1-D
            tensor is sliced along its only dimension), in Hugging Face layout.
        """
        t = self._tensor(name)
        shape = self.shape(name)
        if dim is None:
            dim, start, end = 0, 0, shape[0]
        if dim not in (0, 1) or dim >= len(shape):
            raise ValueError(f"{name}: cannot slice dim {dim} of a tensor of shape {shape}")
        lo = 0 if start is None else int(start)
        hi = shape[dim] if end is None else int(end)
        if not 0 <= lo <= hi <= shape[dim]:
            raise ValueError(f"{name}: range [{lo}, {hi}) out of bounds for {shape} at dim {dim}")
        if lo == hi:  # a rank holding none of this tensor (no bytes to dequantize)
            return torch.zeros([*shape[:dim], 0, *shape[dim + 1 :]])
        perm = self._row_index(name, shape[0])
        rows: slice | np.ndarray
        if len(shape) == 1:  # one GGUF row: slice its columns (a permuted bias: gather them)
            rows, cols = (slice(None), (lo, hi)) if perm is None else (perm[lo:hi], (0, 0))
        elif dim == 0:
            rows = perm[lo:hi] if perm is not None else slice(lo, hi)
            cols = (0, shape[1])
        else:
            rows = perm if perm is not None else slice(None)
            cols = (lo, hi)
        return self._dequantize(t, rows, cols, vector=len(shape) == 1)

    def _dequantize(
        self, t: GGUFTensor, rows: slice | np.ndarray, cols: tuple[int, int], vector: bool
    ) -> torch.Tensor:
        qtype = t.tensor_type
        data = t.data
        if vector:
            if isinstance(rows, np.ndarray):  # element indices of a permuted bias
                full = gguf.quants.dequantize(np.asarray(data).reshape(1, -1), qtype).reshape(-1)
                self.bytes_read += int(data.nbytes)
                return torch.from_numpy(np.array(full[rows], dtype=np.float32))
            data = data.reshape(1, -1)
        part = data[rows]
        c0, c1 = cols
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            part = part[:, c0:c1]
            arr = part.astype(np.float32)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            b0, b1 = c0 // block, -(-c1 // block)
            part = np.ascontiguousarray(part[:, b0 * type_size : b1 * type_size])
            arr = gguf.quants.dequantize(part, qtype)[:, c0 - b0 * block : c1 - b0 * block]
        self.bytes_read += int(part.nbytes)
        out = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))
        return out.reshape(-1) if vector else out

    # -- metadata ------------------------------------------------------------------------
    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (``llama.block_count``, ``tokenizer.ggml.pre``, ...)."""
        if self._reader is None:
            raise ValueError("GGUFReader is closed")
        return _field(self._reader, key, default)

    def config(self) -> dict[str, Any]:
        """The model's Hugging Face ``config.json`` as a dict (see :func:`config_from_gguf`)."""
        a = self.arch

        def key(name: str, default: Any = None) -> Any:
            return self.metadata(f"{a}.{name}", default)

        try:
            hidden = int(key("embedding_length"))
            n_head = int(key("attention.head_count"))
            cfg: dict[str, Any] = {
                "architectures": [GGUF_ARCHITECTURES[a]],
                "model_type": GGUF_ARCHITECTURES[a].removesuffix("ForCausalLM").lower(),
                "hidden_size": hidden,
                "intermediate_size": int(key("feed_forward_length")),
                "num_hidden_layers": int(key("block_count")),
                "num_attention_heads": n_head,
                "num_key_value_heads": int(key("attention.head_count_kv", n_head)),
                "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
                "rope_theta": _f32(key("rope.freq_base", 10000.0)),
                "max_position_embeddings": int(key("context_length", 2048)),
            }
        except TypeError as e:
            raise UserError(f"{self.path}: incomplete {a} metadata ({e})") from e
        if "model.embed_tokens.weight" in self:
            cfg["vocab_size"] = self.shape("model.embed_tokens.weight")[0]
        else:
            cfg["vocab_size"] = int(key("vocab_size", 0))
        cfg["tie_word_embeddings"] = "lm_head.weight" not in self
        head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or 0)
        if head_dim and head_dim != hidden // n_head:
            cfg["head_dim"] = head_dim
        if a == "llama" and "mistral" in str(self.metadata("general.name", "")).lower():
            cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
        if a == "llama":
            cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self
        rope_scaling = self._rope_scaling(head_dim or hidden // n_head, cfg["rope_theta"])
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
        for role in ("bos", "eos", "padding"):
            tid = self.metadata(f"tokenizer.ggml.{role}_token_id")
            if tid is not None:
                cfg["pad_token_id" if role == "padding" else f"{role}_token_id"] = int(tid)
        return cfg

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        kind = self.metadata(f"{self.arch}.rope.scaling.type")
        factor = self.metadata(f"{self.arch}.rope.scaling.factor")
        if kind in ("linear", "yarn") and factor is not None:
            out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
            orig = self.metadata(f"{self.arch}.rope.scaling.original_context_length")
            if orig is not None:
                out["original_max_position_embeddings"] = int(orig)
            return out
        if ROPE_FREQS in self._extra:
            t = self._extra[ROPE_FREQS]
            factors = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)
            return llama3_scaling_from_factors(factors.astype(np.float64), head_dim, theta)
        return None

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the memory map (tensors already read stay valid)."""
        self._tensors.clear()
        self._extra.clear()
        self._reader = None

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def config_from_gguf(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json``-style dict from a GGUF file's metadata.

    Keys: ``architectures``, ``model_type``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``,
    ``rope_theta``, ``max_position_embeddings``, ``vocab_size`` (rows of ``token_embd``),
    ``tie_word_embeddings`` (no ``output.weight``), ``head_dim`` (only where it differs from
    ``hidden_size // num_attention_heads``), ``rope_scaling`` (linear/yarn from metadata,
    llama3 recovered from the ``rope_freqs`` tensor), ``bos/eos/pad_token_id``.
    """
    with GGUFReader(path) as r:
        return r.config()


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors ``[head_dim // 2]`` that llama.cpp stores as ``rope_freqs``
    for Hugging Face ``rope_scaling`` of type llama3."""
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, out)
    return np.where(wavelen > old_ctx / low, factor, out).astype(np.float32)  # type: ignore[no-any-return]


def llama3_scaling_from_factors(
    factors: np.ndarray, head_dim: int, theta: float
) -> dict[str, Any] | None:
    """Recover llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors ``[head_dim/2]``.

    ``factor`` is the largest divisor. The smoothly interpolated band gives the line
    ``s = old_ctx / (high - low) · (1/wavelen) - low / (high - low)``; with ``low_freq_factor``
    taken as 1 (every published llama3 config), two or more points of the band fix
    ``high_freq_factor`` and ``original_max_position_embeddings``. With fewer, Meta's values
    (1, 4, 8192) are assumed.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    band = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    out: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if band.sum() >= 2:
        s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        x = freqs[band] / (2 * math.pi)
        a, b = np.polyfit(x, s, 1)
        if b < 0:
            out["high_freq_factor"] = round(float(1.0 - 1.0 / b), 4)
            out["original_max_position_embeddings"] = round(float(-a / b))
    return out
