"""Export a Hugging Face state dict as a GGUF file that llama.cpp and ollama load.

The metadata follows llama.cpp's converter: ``general.architecture`` (``llama`` for Llama,
SmolLM and Mistral; ``qwen2``; ``qwen3``), the ``<arch>.*`` hyper-parameters, and the
byte-level BPE tokenizer as ``tokenizer.ggml.*`` (tokens padded with ``[PAD<i>]`` to the
embedding's rows, merges, token types, special ids, ``add_bos_token``, the pre-tokenizer name
and the chat template). For ``llama`` the q/k projection rows are permuted into llama.cpp's
interleaved rotary layout, and llama3 rope scaling is stored as the ``rope_freqs`` tensor.
Norms and biases stay F32; matrices are F32, F16 or Q8_0 (a matrix whose rows are not a
multiple of Q8_0's 32-column block falls back to F16).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import gguf
import tokenizers
import torch

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model.gguf_io import (
    HF_TO_GGUF_ARCH,
    PERMUTED_ARCHS,
    ROPE_FREQS,
    hf_to_gguf_name,
    llama3_rope_factors,
    permute_qk,
)
from xronos.model.gguf_tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED, detect_pre

GGUFDtype = Literal["f32", "f16", "q8_0"]
_QTYPE = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def write_gguf(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    tokenizer: str | os.PathLike[str] | tokenizers.Tokenizer,
    chat_template: str | None = None,
    dtype: GGUFDtype = "f16",
    *,
    special_ids: Mapping[str, int] | None = None,
    add_bos: bool | None = None,
    pre: str | None = None,
    name: str | None = None,
) -> Path:
    """Write ``state_dict`` as the GGUF file ``path`` (atomically).

    Args:
        path: the ``.gguf`` file to create.
        state_dict: Hugging Face names and layout (``[out, in]``); a tied model needs no
            ``lm_head.weight`` (one equal to the embedding is dropped).
        config: the Hugging Face ``config.json`` dict (``ModelConfig.to_hf_dict()``).
        tokenizer: a ``tokenizer.json`` file, a directory holding one, or a
            ``tokenizers.Tokenizer``; byte-level BPE only.
        chat_template: Jinja2 source stored as ``tokenizer.chat_template``.
        dtype: storage of the matrices: ``"f32"``, ``"f16"`` or ``"q8_0"``.
        special_ids: ``{"bos": 1, "eos": 2, "pad": 2, "unk": 0}``; bos/eos default to the
            config's ``bos_token_id``/``eos_token_id``.
        add_bos: ``tokenizer.ggml.add_bos_token``; default: whether the tokenizer's own
            post-processor prepends BOS.
        pre: ``tokenizer.ggml.pre``; default: detected from the tokenizer's pre-tokenizer.
        name: ``general.name``; default: from the config or the architecture.
    Raises:
        UserError: unsupported architecture, dtype or tokenizer, or an unknown tensor name.
    """
    if dtype not in _QTYPE:
        raise UserError(f"GGUF dtype {dtype!r}: use one of {', '.join(_QTYPE)}")
    cfg = ModelConfig.from_hf_dict(dict(config), source="model config")
    arch = HF_TO_GGUF_ARCH[cfg.architecture]
    backend = _load_tokenizer(tokenizer)
    ids = _special_ids(cfg, special_ids)
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    try:
        _write_metadata(w, cfg, arch, dtype, name or _default_name(config, cfg))
        _write_tokenizer(w, backend, cfg.vocab_size, ids, add_bos, pre, chat_template)
        _add_tensors(w, state_dict, cfg, arch, dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _default_name(config: Mapping[str, Any], cfg: ModelConfig) -> str:
    given = str(config.get("_name_or_path") or "")
    base = Path(given).name if given else cfg.architecture.removesuffix("ForCausalLM")
    # transformers tells a Mistral file (architecture llama) by its name
    if cfg.architecture == "MistralForCausalLM" and "mistral" not in base.lower():
        base = f"mistral {base}"
    return base


def _special_ids(cfg: ModelConfig, given: Mapping[str, int] | None) -> dict[str, int]:
    ids: dict[str, int] = {}
    if cfg.bos_token_id is not None:
        ids["bos"] = int(cfg.bos_token_id)
    eos = cfg.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        ids["eos"] = int(eos)
    ids.update({k: int(v) for k, v in (given or {}).items() if v is not None})
    return ids


def _write_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, arch: str, dtype: str, name: str) -> None:
    w.add_name(name)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads or arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    w.add_file_type(int(_FILE_TYPE[dtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# -- tokenizer ------------------------------------------------------------------------------
def _load_tokenizer(tok: str | os.PathLike[str] | tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    if isinstance(tok, tokenizers.Tokenizer):
        return tok
    path = Path(tok)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{path}: no tokenizer.json to store in the GGUF file")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(f"{path}: unreadable tokenizer ({e})") from e


def _write_tokenizer(
    w: gguf.GGUFWriter,
    backend: tokenizers.Tokenizer,
    vocab_size: int,
    ids: dict[str, int],
    add_bos: bool | None,
    pre: str | None,
    chat_template: str | None,
) -> None:
    """``tokenizer.ggml.*``: tokens and types by id (padded to ``vocab_size``), merges, ids."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(
            f"tokenizer model {model.get('type')!r}: GGUF export supports byte-level BPE only"
        )
    tokens: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types = dict.fromkeys(tokens, NORMAL)
    for added in spec.get("added_tokens") or []:
        tokens[int(added["id"])] = added["content"]
        types[int(added["id"])] = CONTROL if added.get("special") else USER_DEFINED
    n = max(tokens) + 1
    if n > vocab_size:
        raise UserError(
            f"the tokenizer has {n} tokens but the model's embedding only {vocab_size} rows"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or detect_pre(backend))
    w.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    w.add_token_types([types.get(i, UNUSED) for i in range(vocab_size)])
    w.add_token_merges(merges)
    setters = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "pad": w.add_pad_token_id,
        "unk": w.add_unk_token_id,
    }
    for key, tid in ids.items():
        if key in setters:
            setters[key](tid)
    if add_bos is None:
        add_bos = _adds_first(backend, ids.get("bos"))
    w.add_add_bos_token(bool(add_bos))
    w.add_add_space_prefix(False)
    if chat_template:
        w.add_chat_template(chat_template)


def _adds_first(backend: tokenizers.Tokenizer, bos: int | None) -> bool:
    """Whether ``backend.encode(..., add_special_tokens=True)`` prepends ``bos``."""
    if bos is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(plain) and with_special[0] == bos


# -- tensors --------------------------------------------------------------------------------
def _order(name: str) -> tuple[int, int, str]:
    """token_embd, blocks by index, output_norm, output: the order llama.cpp writes."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def _add_tensors(
    w: gguf.GGUFWriter,
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    arch: str,
    dtype: str,
) -> None:
    names = sorted(state, key=_order)
    if cfg.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    elif "lm_head.weight" not in state:
        raise UserError("untied model without lm_head.weight; cannot write output.weight")
    for hf in names:
        gname = hf_to_gguf_name(hf)
        if gname is None:
            raise UserError(f"tensor {hf!r} has no GGUF counterpart; merge adapters first")
        t = state[hf].detach().to(device="cpu", dtype=torch.float32)
        if arch in PERMUTED_ARCHS and (".q_proj." in hf or ".k_proj." in hf):
            n_head = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads
            t = permute_qk(t, n_head)
        arr = t.contiguous().numpy()
        qtype = _QTYPE[dtype] if arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.Q8_0 and arr.shape[-1] % 32:
            qtype = gguf.GGMLQuantizationType.F16
        data = gguf.quants.quantize(arr, qtype)
        raw = (
            None
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            else qtype
        )
        w.add_tensor(gname, data, raw_dtype=raw)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        factors = llama3_rope_factors(cfg.head_dim, cfg.rope_theta, scaling)
        w.add_tensor(ROPE_FREQS, factors)
