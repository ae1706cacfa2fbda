"""``xronos generate``: greedy decoding, single-process or tensor-parallel."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xronos.cli.common import add_model_arg, parse_shares
from xronos.comm.launch import WorkerContext, launch
from xronos.comm.mappings import TPGroup
from xronos.data import check_vocab, encode_chat, encode_prompt
from xronos.errors import UserError
from xronos.model.gguf_resolve import resolve_tokenizer
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import Plan
from xronos.run.generate import GenerateJob, generate_worker
from xronos.train.source import ModelSource


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="greedy decoding (optionally tensor-parallel)")
    add_model_arg(p)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as one user message through the model's chat template",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="default: %(default)s")
    p.add_argument("--devices", type=int, default=1, help="local processes (default: 1)")
    p.add_argument(
        "--shares", help="relative share of every segment per device, e.g. 2,1,1 (default: even)"
    )
    p.add_argument("--ids", action="store_true", help="print generated token ids, not text")
    p.add_argument("--seed", type=int, default=0, help="preset weight seed (default: 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.set_defaults(run=run)


def run_source(model: str, seed: int) -> tuple[ModelSource, str | None, str]:
    """(weights source, checkpoint or None, base model name) for a preset, a Hugging Face
    directory, a GGUF file, or a run directory of ``xronos finetune`` (its latest checkpoint)."""
    path = Path(model)
    if not (path / "checkpoints").is_dir() and not (path / "COMPLETE").is_file():
        return ModelSource.from_name(model, seed), None, model
    from xronos.checkpoint import read_checkpoint_meta
    from xronos.cli.export import checkpoint_of

    ckpt = checkpoint_of(model)
    meta = read_checkpoint_meta(ckpt)
    saved = meta.get("extra", {}).get("model", {})
    base = saved.get("dir") or saved.get("preset")
    if not base:
        raise UserError(f"{ckpt}: the checkpoint does not name its base model")
    lora = meta.get("lora")
    source = ModelSource.from_name(
        base,
        int(saved.get("seed", 0)),
        LoRAConfig(
            r=lora["r"],
            alpha=lora["alpha"],
            dropout=lora.get("dropout", 0.0),
            target_modules=tuple(lora["target_modules"]),
        )
        if lora
        else None,
    )
    return source, str(ckpt), base


def run(args: argparse.Namespace) -> int:
    shares = parse_shares(args.shares, args.devices)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    source, checkpoint, base = run_source(args.model, args.seed)
    tok = resolve_tokenizer(base)
    check_vocab(tok, source.cfg.vocab_size)
    if args.chat and tok.chat_template is None:
        raise UserError(f"--chat: {base} has no chat template; give the prompt without --chat")
    if args.chat:  # as transformers' apply_chat_template(..., add_generation_prompt=True)
        prompt = tuple(encode_chat(tok, [{"role": "user", "content": args.prompt}]))
    else:  # as transformers' tokenizer(prompt), and as training sequences start
        prompt = tuple(encode_prompt(tok, args.prompt))
    if not prompt:
        raise UserError("--prompt is empty after tokenisation; give some text")
    if len(prompt) + args.max_new_tokens > source.cfg.max_position_embeddings:
        raise UserError(
            f"prompt ({len(prompt)} tokens) + --max-new-tokens exceeds the model's context of "
            f"{source.cfg.max_position_embeddings}; shorten the prompt or generate fewer tokens"
        )
    eos = source.cfg.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    devices = [f"dev{i}" for i in range(args.devices)]
    plan = Plan.from_shares(source.cfg, shares, devices, strategy="shares")
    job = GenerateJob(
        checkpoint=checkpoint,
        model=source,
        plan=plan,
        prompts=(prompt,),
        max_new_tokens=args.max_new_tokens,
        eos_ids=eos_ids,
    )
    if args.devices == 1:
        out = generate_worker(WorkerContext(0, 1, "dev0", TPGroup(), args.timeout), job)[0]
    else:
        out = launch(generate_worker, [job] * args.devices, devices, timeout_s=args.timeout)[0][0]
    print(" ".join(map(str, out)) if args.ids else tok.decode(out))
    return 0
