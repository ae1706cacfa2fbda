"""The writer's GGUF files as transformers' own GGUF loader reads them: the same logits as the
Hugging Face model they were written from, and the same token ids where the two tokenizer
converters agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_gguf_io import TEMPLATE, make_model, make_tokenizer, smollm2_file
from xronos.export.gguf import write_gguf
from xronos.model.gguf_tokenizer import tokenizer_from_gguf

tf = pytest.importorskip("transformers")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", False)])
def test_transformers_gguf_loader_gives_the_same_logits(
    tmp_path: Path, arch: str, tied: bool
) -> None:
    d, state, config = make_model(tmp_path, arch, tied=tied)
    write_gguf(d / "m.gguf", state, config, make_tokenizer(), TEMPLATE, "f32")
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    got = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32)
    assert type(got) is type(ref)
    assert got.config.tie_word_embeddings is tied
    torch.testing.assert_close(_logits(got.eval(), IDS), _logits(ref, IDS), rtol=1e-5, atol=1e-5)


def test_transformers_q8_0_logits_close(tmp_path: Path) -> None:
    """Q8_0 weights (≈0.4 % relative error each) move logits of a random 2-layer model by a
    few percent of their spread at most."""
    d, state, config = make_model(tmp_path, "llama", tied=False)
    write_gguf(d / "m.gguf", state, config, make_tokenizer(), TEMPLATE, "q8_0")
    ref = _logits(tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), IDS)
    got = _logits(
        tf.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32).eval(),
        IDS,
    )
    assert (got - ref).abs().max() < 0.05 * ref.std()


def test_transformers_qwen3_config_from_gguf(tmp_path: Path) -> None:
    """transformers' qwen3 GGUF mapping does not read ``qwen3.attention.key_length``, so its
    model gets Qwen3Config's default head_dim of 128 whatever the file says (here 16)."""
    d, state, config = make_model(tmp_path, "qwen3", tied=True, head_dim=16)
    write_gguf(d / "m.gguf", state, config, make_tokenizer(), TEMPLATE, "f32")
    try:
        tf.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32)
    except RuntimeError as e:
        pytest.skip(f"transformers builds a qwen3 GGUF with head_dim 128, shapes mismatch: {e}")


def test_transformers_qwen3_tensors_give_the_same_logits(tmp_path: Path) -> None:
    """With the config given, transformers' GGUF tensor loading of a qwen3 file (q/k norms,
    no permutation) gives the original logits; head_dim 32 != 64 / 4 as in real Qwen3."""
    d, state, config = make_model(tmp_path, "qwen3", tied=True)
    write_gguf(d / "m.gguf", state, config, make_tokenizer(), TEMPLATE, "f32")
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    got = tf.AutoModelForCausalLM.from_pretrained(
        d, gguf_file="m.gguf", config=ref.config, dtype=torch.float32
    )
    torch.testing.assert_close(_logits(got.eval(), IDS), _logits(ref, IDS), rtol=1e-5, atol=1e-5)


DIGIT_FREE = [
    "turn on the kitchen light please",
    "it's late, I'M home; don't wait",
    "Ünïcödé wörds: café, naïve",
    "<|im_start|>user\nhello<|im_end|>",
]


def test_tokenizer_ids_match_transformers(tmp_path: Path) -> None:
    d, state, config = make_model(tmp_path, "llama", tied=True)
    write_gguf(d / "m.gguf", state, config, make_tokenizer("smollm"), TEMPLATE, "f32")
    ours, _, _ = tokenizer_from_gguf(d / "m.gguf")
    theirs = tf.AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    for text in DIGIT_FREE:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(
            text, add_special_tokens=False
        ), text


def test_smollm_digits_differ_from_transformers(tmp_path: Path) -> None:
    """A vocabulary with multi-digit tokens under ``tokenizer.ggml.pre = smollm``: llama.cpp
    splits every digit first, so ours does; transformers' GGUF converter has no smollm rule
    and uses the plain GPT-2 split, which keeps ``2024`` whole for the merges to join."""
    d, state, config = make_model(tmp_path, "llama", tied=True)
    write_gguf(d / "m.gguf", state, config, make_tokenizer("gpt2"), TEMPLATE, "f32", pre="smollm")
    ours, _, _ = tokenizer_from_gguf(d / "m.gguf")
    theirs = tf.AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    text = "call 1234567890 now"
    enc = ours.encode(text, add_special_tokens=False)
    assert [t for t in enc.tokens if t.strip("Ġ").isdigit()] == list("1234567890")
    other = theirs.convert_ids_to_tokens(theirs.encode(text, add_special_tokens=False))
    assert any(len(t.strip("Ġ")) > 1 and t.strip("Ġ").isdigit() for t in other)
    for text in DIGIT_FREE:  # without digits the two agree
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(
            text, add_special_tokens=False
        )


def test_real_smollm2_tokenizer_matches_transformers() -> None:
    """SmolLM2's vocabulary has no multi-digit tokens, so there the two agree even on digits."""
    path = smollm2_file()
    ours, _, _ = tokenizer_from_gguf(path)
    theirs = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in [*DIGIT_FREE, "It is 2024, call 555-0199."]:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(
            text, add_special_tokens=False
        ), text


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_xronos_model_from_gguf_slices_matches_hf(tmp_path: Path, arch: str, tied: bool) -> None:
    """Xronos's model built from ``config_from_gguf`` and per-"rank" slices (rows, then
    columns, split in two at a head boundary) gives the Hugging Face model's logits."""
    from xronos.config import ModelConfig
    from xronos.model.gguf_io import GGUFReader, config_from_gguf
    from xronos.model.llama import LlamaForCausalLM

    d, state, config = make_model(tmp_path, arch, tied=tied)
    write_gguf(d / "m.gguf", state, config, make_tokenizer(), TEMPLATE, "f32")
    cfg = ModelConfig.from_hf_dict(config_from_gguf(d / "m.gguf"))
    model = LlamaForCausalLM(cfg).eval()
    with GGUFReader(d / "m.gguf") as r, torch.no_grad():
        for name, p in model.named_parameters():
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            n = r.shape(name)[dim]
            p.copy_(torch.cat([r.read(name, dim, 0, n // 2), r.read(name, dim, n // 2, n)], dim))
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(IDS)
    torch.testing.assert_close(got, _logits(ref, IDS), rtol=1e-5, atol=1e-5)
