"""Exports of a fine-tuning run's checkpoint: a PEFT LoRA adapter or a merged Hugging Face
model directory. Both read only the checkpoint (plus, for a merged LoRA model, the base
weights) and write their output atomically."""

from xronos.export.adapter import export_peft
from xronos.export.merged import export_hf

__all__ = ["export_hf", "export_peft"]
