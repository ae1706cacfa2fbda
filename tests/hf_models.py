"""Random Hugging Face checkpoints for tests, written with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3")


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = False,
    vocab: int = 96,
    hidden: int = 64,
    intermediate: int = 96,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int | None = None,
    rope_scaling: dict | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> torch.nn.Module:
    """Save a random model of ``arch`` to ``path`` and return the transformers model."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, head_dim=head_dim or hidden // heads)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=head_dim or 2 * hidden // heads)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases; make them count in the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


WORDS = [
    *("turn", "on", "off", "the", "light", "in", "kitchen", "bedroom", "set", "heat", "to"),
    *("please", "lamp", "fan", "open", "close", "door"),
]


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordLevel ``tokenizer.json`` (+ config) whose ids fit ``vocab_size``; adds BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}'
    )
