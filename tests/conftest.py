"""Test-wide settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# gloo silently returns wrong data on shape mismatches unless asked to check them.
os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `xronos finetune` without --model fine-tunes the random `tiny` preset in tests, not the
# pretrained default model (which is not a requirement of the test suite).
os.environ.setdefault("XRONOS_DEFAULT_MODEL", "tiny")


@pytest.fixture(scope="session", autouse=True)
def _own_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Directories of the suite's own, under pytest's base directory (which pytest prunes):
    the programs the tests start keep their temporary files there, not in the host's /tmp
    (torchrun's agents each leave a log directory there); and the profile cache
    (``XDG_CACHE_HOME``) is the suite's, so the tests neither plan from profiles the user's
    runs cached nor leave theirs in the user's home, and a run here profiles what a clean
    clone's run profiles (the tests still share it, as one user's runs do)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmp")))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield
