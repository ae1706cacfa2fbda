"""``xronos export``: a run's result as a PEFT adapter or a merged Hugging Face model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from xronos.errors import UserError


def register(sub: Any) -> None:
    p = sub.add_parser("export", help="export a run as a PEFT adapter or a merged HF model")
    p.add_argument("run_dir", help="run directory (or one of its checkpoints)")
    p.add_argument("--format", required=True, choices=("peft", "hf"), help="what to write")
    p.add_argument("--out", required=True, help="output directory")
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
    from xronos.data import resolve_tokenizer
    from xronos.export import export_hf, export_peft

    ckpt = checkpoint_of(args.run_dir)
    extra = read_checkpoint_meta(ckpt).get("extra", {})
    model = extra.get("model", {})
    base = model.get("dir") or model.get("preset")
    if args.format == "peft":
        out = export_peft(ckpt, args.out, base_model=base)
    else:
        tok = resolve_tokenizer(base) if base else None
        out = export_hf(ckpt, args.out, base_model_dir=model.get("dir"), tokenizer=tok)
    print(json.dumps({"checkpoint": str(ckpt), "format": args.format, "out": str(out)}))
    return 0
