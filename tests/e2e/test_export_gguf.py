"""``xronos export RUN --format gguf`` writes the merged fine-tuned model that llama.cpp,
ollama and transformers' GGUF loader read: the same logits as ``--format hf`` within what
the storage dtype allows, the run's tokenizer, special ids and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from tests.e2e.test_export import _fine_tune, _hf_logits, _ids
from tests.hf_models import make_checkpoint
from tests.unit.test_gguf_io import TEMPLATE, VOCAB, make_tokenizer
from xronos.cli import main
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.export.gguf import write_gguf
from xronos.model.gguf_io import GGUFReader
from xronos.model.lora import LoRAConfig
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan

tf = pytest.importorskip("transformers")

#: Largest |Δlogit| allowed, as a fraction of the logits' standard deviation (random
#: 2-layer model, logits ~N(0, ~0.3)). f32 stores the merged weights exactly, so only the
#: order of summation differs (≲1e-6 relative). f16 rounds each weight by ≤ 2^-11 relative
#: (4.9e-4); summed over 64-wide dot products in two layers that moves logits by ~1e-3 of
#: their spread, so 1 % leaves margin. Q8_0 rounds each weight to 1/127 of its block's
#: largest value (≈0.4 % of a typical weight), a few percent of the spread at most.
TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "q8_0": 5e-2}


def _base(root: Path) -> tuple[Path, Path]:
    """A random Llama directory with a byte-level BPE tokenizer and chat template, and the
    same model written as an f32 GGUF file next to it."""
    d = root / "base"
    hf = make_checkpoint(d, "llama", vocab=VOCAB, seed=3)
    tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=make_tokenizer("smollm"),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )
    tok.save_pretrained(d)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    config = json.loads((d / "config.json").read_text())
    path = write_gguf(root / "base.gguf", state, config, d / "tokenizer.json", TEMPLATE, "f32")
    return d, path


def _ours(path: Path, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the model Xronos builds from a GGUF file (its GGUFReader)."""
    model = build_model(cfg, Plan.single(cfg), TPGroup(), model_dir=path).eval()
    with torch.no_grad():
        return model(ids)


@pytest.mark.slow
def test_gguf_export_of_a_lora_run_on_a_gguf_base(tmp_path: Path) -> None:
    d, base_gguf = _base(tmp_path)
    cfg = ModelConfig.from_pretrained(d)
    tuned, _ = _fine_tune(
        cfg,
        tmp_path / "run",
        model_dir=base_gguf,  # trained from the GGUF file: the checkpoint records it
        lora=LoRAConfig(r=4, alpha=8.0),
        seed=0,
        extra_model={"dir": str(base_gguf), "seed": 0},
    )
    ids = _ids(cfg)
    with torch.no_grad():
        want = tuned(ids)
    assert (
        main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")])
        == 0
    )
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    hf_logits = _hf_logits(merged, ids)
    torch.testing.assert_close(hf_logits, want, atol=1e-5, rtol=0)  # fp32 both sides
    base_logits = _ours(base_gguf, cfg, ids)
    assert (base_logits - want).abs().max() > 1e-3, "the adapters changed nothing"

    spread = float(hf_logits.std())
    for dtype, tol in TOLERANCE.items():
        out = tmp_path / f"m-{dtype}.gguf"
        args = ["export", str(tmp_path / "run"), "--format", "gguf", "--dtype", dtype]
        assert main([*args, "--out", str(out)]) == 0
        ours = _ours(out, cfg, ids)
        assert (ours - hf_logits).abs().max() <= tol * spread, dtype
        theirs = tf.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=out.name, dtype=torch.float32
        ).eval()
        assert (_hf_logits(theirs, ids) - hf_logits).abs().max() <= tol * spread, dtype
        with GGUFReader(out) as r:
            assert r.tensor_type("model.layers.0.mlp.up_proj.weight") == dtype.upper()
            assert r.tensor_type("model.norm.weight") == "F32"  # norms stay F32 (llama.cpp)


def _field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


@pytest.mark.slow
def test_gguf_export_carries_the_runs_tokenizer(tmp_path: Path) -> None:
    """The metadata llama.cpp/ollama use to tokenize and stop: the run's vocabulary, BOS
    and EOS ids, whether BOS is added (this tokenizer adds none), pre-tokenizer, template."""
    d, _ = _base(tmp_path)
    cfg = ModelConfig.from_pretrained(d)
    _fine_tune(
        cfg,
        tmp_path / "run",
        model_dir=d,
        lora=LoRAConfig(r=4),
        seed=0,
        extra_model={"dir": str(d), "seed": 0},
    )
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), "--format", "gguf", "--out", str(out)]) == 0
    r = gguf.GGUFReader(out / "model.gguf")
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "smollm"
    assert int(_field(r, "tokenizer.ggml.bos_token_id")) == 1  # type: ignore[call-overload]
    assert int(_field(r, "tokenizer.ggml.eos_token_id")) == 2  # type: ignore[call-overload]
    assert bool(_field(r, "tokenizer.ggml.add_bos_token")) is False
    assert _field(r, "tokenizer.chat_template") == TEMPLATE
    theirs = tf.AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    mine = tf.AutoTokenizer.from_pretrained(d)
    text = "turn on the kitchen light please"
    assert theirs(text)["input_ids"] == mine(text)["input_ids"]
