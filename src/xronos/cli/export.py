"""``xronos export``: a run's result as a PEFT adapter, a merged HF model or a GGUF file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from xronos.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="export a run as a PEFT adapter, a merged HF model or a GGUF file"
    )
    p.add_argument("run_dir", help="run directory (or one of its checkpoints)")
    p.add_argument("--format", required=True, choices=("peft", "hf", "gguf"), help="what to write")
    p.add_argument(
        "--out", required=True, help="output directory (gguf: a .gguf file or a directory)"
    )
    p.add_argument(
        "--dtype",
        choices=("f16", "q8_0", "f32"),
        default="f16",
        help="gguf: storage of the matrices (default: %(default)s)",
    )
    p.add_argument(
        "--base-model",
        help="the base model (directory or .gguf file) if it moved since training",
    )
    p.set_defaults(run=run)


def checkpoint_of(path: str) -> Path:
    from xronos.checkpoint import latest_checkpoint

    p = Path(path)
    if (p / "COMPLETE").is_file():
        return p
    if not p.is_dir():
        raise UserError(f"{path}: no such run directory")
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise UserError(f"{path}: no complete checkpoint in {p / 'checkpoints'}; train first")
    return ckpt


def run(args: argparse.Namespace) -> int:
    from xronos.checkpoint import read_checkpoint_meta
    from xronos.export import export_gguf, export_hf, export_peft
    from xronos.model.gguf_resolve import resolve_tokenizer

    ckpt = checkpoint_of(args.run_dir)
    extra = read_checkpoint_meta(ckpt).get("extra", {})
    model = extra.get("model", {})
    base_dir = args.base_model or model.get("dir")
    base = base_dir or model.get("preset")
    if args.format == "peft":
        out = export_peft(ckpt, args.out, base_model=base)
    elif args.format == "hf":
        tok = resolve_tokenizer(base) if base else None
        out = export_hf(ckpt, args.out, base_model_dir=base_dir, tokenizer=tok)
    else:
        if not base:
            raise UserError(f"{ckpt}: the checkpoint does not name its base model's tokenizer")
        tok = resolve_tokenizer(base)
        out = export_gguf(ckpt, args.out, tokenizer=tok, base_model=base_dir, dtype=args.dtype)
    print(json.dumps({"checkpoint": str(ckpt), "format": args.format, "out": str(out)}))
    return 0
