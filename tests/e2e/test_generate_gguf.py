"""``xronos generate --model X --devices 3 --shares 3,2,1 --ids`` prints transformers' greedy
tokens, for a plain prompt and a ``--chat`` one, where X is the real SmolLM2-135M-Instruct
GGUF (skipped when its package is absent), a GGUF file written by the tests, or a Hugging
Face directory whose tokenizer adds no BOS."""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import make_checkpoint
from tests.unit.test_gguf_io import TEMPLATE, VOCAB, make_tokenizer, smollm2_file
from xronos.cli import main
from xronos.export.gguf import write_gguf

tf = pytest.importorskip("transformers")

NEW_TOKENS = 24
#: TEMPLATE with a generation prompt, as real chat templates have.
CHAT_TEMPLATE = TEMPLATE + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _xronos_ids(model: str, prompt: str, *, chat: bool) -> list[int]:
    """``xronos generate``'s printed ids (the CLI run in this process, its workers forked
    as in any run; pytest's capture holds what it prints)."""
    args = ["generate", "--model", model, "--prompt", prompt, "--ids"]
    args += ["--max-new-tokens", str(NEW_TOKENS), "--devices", "3", "--shares", "3,2,1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, *(["--chat"] if chat else [])]) == 0
    return [int(t) for t in out.getvalue().split()]


def _gguf_template(path: Path) -> str:
    """``tokenizer.chat_template`` of a GGUF file, read with the ``gguf`` package (the
    transformers tokenizer built from a GGUF file does not carry it)."""
    import gguf

    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def _one_parse(reader: Callable[..., Any]) -> Callable[..., Any]:
    """``reader`` that parses each file once: later calls for the same file and mode get the
    first call's reader (read-only memory maps: nothing that reads through it changes it)."""
    parsed: dict[tuple[str, str], Any] = {}

    def read(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = reader(path, mode)
        return parsed[key]

    return read


def _transformers_ids(
    model: object, tok: object, prompt: str, *, chat: bool, template: str | None = None
) -> list[int]:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=True, chat_template=template
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tok(prompt)["input_ids"]  # type: ignore[operator]
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, x.shape[1] :].tolist()]


def _check(model_arg: str, ref: object, tok: object, prompt: str, *, chat: bool) -> list[int]:
    template = _gguf_template(Path(model_arg)) if model_arg.endswith(".gguf") else None
    want = _transformers_ids(ref, tok, prompt, chat=chat, template=template)
    got = _xronos_ids(model_arg, prompt, chat=chat)
    assert got == want
    return got


@pytest.mark.slow
def test_real_smollm2_gguf_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    # the chat prompt only: plain prompts of GGUF files are covered on the written file
    # below, and the real model is the slowest test of the suite
    chat = True
    path = smollm2_file()
    import gguf

    # Two costs of transformers' GGUF loader that are the same work done again, cut without
    # changing what it computes: it parses the file anew for its config, its weights and
    # its tokenizer, and _gguf_template once more (about 6 s each here: 49152 tokens and
    # their merges), and it builds gguf's tensor name map of the architecture once per
    # module of the model (397 times, about 10 s in all). The file does not change and the
    # map depends on the architecture and the layer count alone: one of each serves all.
    monkeypatch.setattr(gguf, "GGUFReader", _one_parse(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    # transformers dequantizes the Q4_1 file to fp32, as Xronos's reader does.
    ref = tf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # A plain prompt to continue (the question alone is answered by EOS at once).
    prompt = "What is the capital of France?" if chat else "The capital of France is"
    got = _check(str(path), ref, tok, prompt, chat=chat)
    assert len(got) >= 6  # a real answer, not an immediate EOS
    assert "Paris" in tok.decode(got)


def _no_bos_dir(root: Path) -> tuple[Path, object]:
    """A random Llama with a byte-level BPE tokenizer whose post-processor adds nothing."""
    ref = make_checkpoint(root, "llama", vocab=VOCAB, heads=4, kv_heads=4, seed=5).eval()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=make_tokenizer("smollm", bos=False),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(root)
    return root, ref


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_hf_dir_without_bos_matches_transformers(tmp_path: Path, chat: bool) -> None:
    d, ref = _no_bos_dir(tmp_path / "m")
    tok = tf.AutoTokenizer.from_pretrained(d)
    prompt = "turn on the kitchen light please"
    assert tok(prompt)["input_ids"][0] != tok.bos_token_id  # the case under test: no BOS
    _check(str(d), ref, tok, prompt, chat=chat)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_written_gguf_matches_transformers(tmp_path: Path, chat: bool) -> None:
    """A GGUF file the writer made from the same random Llama (q/k rows permuted on the way
    in and back), read by transformers' GGUF loader and by Xronos."""
    d, ref = _no_bos_dir(tmp_path / "m")
    state = {k: v.detach() for k, v in ref.state_dict().items()}
    config = ref.config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    write_gguf(d / "m.gguf", state, config, d / "tokenizer.json", CHAT_TEMPLATE, "f32")
    got_ref = tf.AutoModelForCausalLM.from_pretrained(
        d, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    _check(str(d / "m.gguf"), got_ref, tok, "turn on the kitchen light please", chat=chat)
