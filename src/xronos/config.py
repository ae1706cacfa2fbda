"""Model configuration for the LLaMA family, read from Hugging Face ``config.json``.

One dataclass describes every supported architecture; the differences between Llama,
Qwen2, Qwen3 and Mistral are a handful of switches (``attention_bias``, ``qk_norm``,
``head_dim``, ``rope_scaling``). Both the transformers v4 layout of ``config.json``
(``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the v5 layout
(``rope_parameters``, ``dtype``) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xronos.errors import UserError

#: ``architectures[0]`` in config.json -> the switches that architecture implies.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
#: ``model_type`` -> architecture, for configs that omit ``architectures``.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder."""

    architecture: str = "LlamaForCausalLM"
    """Hugging Face architecture name; decides how the model is exported."""
    vocab_size: int
    """Rows of the token embedding (may exceed the tokenizer's vocabulary)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP (columns of gate/up, rows of down)."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA); one KV group = one KV head + its query heads."""
    head_dim: int = 0
    """Per-head width; 0 means ``hidden_size // num_heads`` (Qwen3 sets it explicitly)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """Hugging Face rope scaling dict (``rope_type`` llama3 or linear), or None."""
    max_position_embeddings: int = 2048
    """Longest sequence the model was trained for."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the token embedding's weight."""
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2/2.5)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other config.json fields, kept so an export can write them back."""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix config.json"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def q_per_kv(self) -> int:
        """Query heads in one KV group."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_group_width(self) -> int:
        """Columns of q + k + v that one KV group owns."""
        return (self.q_per_kv + 2) * self.head_dim

    def num_parameters(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    # -- Hugging Face config.json ------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = (cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type", ""), "")])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"{source}: unsupported architecture {arch or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers v5 layout
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if rope_scaling is not None and "rope_type" not in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type", "default")}
        if rope_scaling is not None and rope_scaling.get("rope_type") == "default":
            rope_scaling = None
        known = {
            "architectures",
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "max_position_embeddings",
            "tie_word_embeddings",
            "attention_bias",
            "bos_token_id",
            "eos_token_id",
        }
        try:
            n_heads = int(cfg["num_attention_heads"])
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or 0),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(
                    cfg.get("attention_bias", SUPPORTED_ARCHITECTURES[arch].get("attention_bias"))
                ),
                qk_norm=bool(SUPPORTED_ARCHITECTURES[arch].get("qk_norm", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                extra={k: v for k, v in cfg.items() if k not in known},
            )
        except KeyError as e:
            raise UserError(
                f"{source}: missing field {e.args[0]!r}; is this a model config?"
            ) from e

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UserError(f"{path}: not found; pass a Hugging Face model directory or a preset")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        return cls.from_hf_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        model_type = {v: k for k, v in MODEL_TYPES.items()}[self.architecture]
        out: dict[str, Any] = {
            **self.extra,
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            out["attention_bias"] = self.attention_bias
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# -- presets ------------------------------------------------------------------------------
def tiny() -> ModelConfig:
    """A few million parameters: the default fine-tune and the test suite."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def small() -> ModelConfig:
    """Hidden 512: big enough that compute dominates an all-reduce; for benchmarks. Sixteen
    KV groups, so that an uneven split of the attention is not too coarse."""
    return ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=2048,
        num_layers=4,
        num_heads=16,
        num_kv_heads=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


PRESETS = {"tiny": tiny, "small": small}


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name or a Hugging Face model directory -> its config."""
    if model in PRESETS:
        return PRESETS[model]()
    path = Path(model)
    if path.is_dir():
        return ModelConfig.from_pretrained(path)
    raise UserError(
        f"model {model!r}: no such directory and not a preset; use one of "
        f"{', '.join(PRESETS)} or a Hugging Face model directory"
    )
