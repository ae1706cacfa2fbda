"""Test-wide settings."""

from __future__ import annotations

import os

# gloo silently returns wrong data on shape mismatches unless asked to check them.
os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `xronos finetune` without --model fine-tunes the random `tiny` preset in tests, not the
# pretrained default model (which is not a requirement of the test suite).
os.environ.setdefault("XRONOS_DEFAULT_MODEL", "tiny")
