"""Xronos: heterogeneity-aware tensor-parallel fine-tuning of LLMs across CPU edge devices."""

__version__ = "0.1.0"
