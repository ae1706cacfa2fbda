"""Single-device LLaMA-family model code."""

from xronos.model.llama import KVCache, LlamaForCausalLM, init_weights

__all__ = ["KVCache", "LlamaForCausalLM", "init_weights"]
