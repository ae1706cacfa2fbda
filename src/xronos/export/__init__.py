"""Exports of a fine-tuning run's checkpoint: a PEFT LoRA adapter or a merged Hugging Face
model directory or GGUF file. All read only the checkpoint (plus, for a merged LoRA model, the base
weights) and write their output atomically."""

from xronos.export.adapter import export_peft
from xronos.export.merged import export_hf
from xronos.export.merged_gguf import export_gguf

__all__ = ["export_gguf", "export_hf", "export_peft"]
