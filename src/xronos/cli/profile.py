"""``xronos profile``: measure every device of a cluster inside its limits."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from xronos.cli.common import add_link_args, add_model_arg
from xronos.emulation import load_cluster
from xronos.emulation.cluster import LinkRequest
from xronos.errors import UserError
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import default_mlp_chunk, default_vocab_chunk
from xronos.planner.profile import DeviceProfile, save_profiles
from xronos.profiler.measure import Shape
from xronos.profiler.run import load_cached, profile_key, profile_worker, store_cached
from xronos.run.launch import DEFAULT_CPU_PERIOD_US, measurement_context, run_on_cluster
from xronos.train.source import ModelSource


def register(sub: Any) -> None:
    p = sub.add_parser(
        "profile", help="profile each device of a cluster (under a minute for small models; cached)"
    )
    p.add_argument("--cluster", default="default", help="cluster preset or TOML file")
    add_model_arg(p)
    p.add_argument("--batch-size", type=int, default=32, help="default: %(default)s")
    p.add_argument("--seq-len", type=int, default=64, help="default: %(default)s")
    p.add_argument("--lora-rank", type=int, default=0, help="profile LoRA training (0 = full)")
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="profile training that computes each block's forward again in backward",
    )
    p.add_argument("--out", default="profile.json", help="default: %(default)s")
    p.add_argument("--no-cache", action="store_true", help="measure even if cached")
    p.add_argument("--no-emulation", action="store_true", help="run without device limits")
    add_link_args(p)
    p.set_defaults(run=run)


def shape_for(
    model: str, batch_size: int, seq_len: int, lora_rank: int, recompute: bool = False
) -> Shape:
    if batch_size < 1 or seq_len < 2:
        raise UserError("--batch-size must be ≥ 1 and --seq-len ≥ 2")
    cfg = ModelSource.from_name(model).cfg
    return Shape(
        cfg=cfg,
        batch_size=batch_size,
        seq_len=seq_len,
        mlp_chunk=default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk=default_vocab_chunk(cfg.vocab_size),
        lora=LoRAConfig(r=lora_rank) if lora_rank > 0 else None,
        recompute=recompute,
    )


def run(args: argparse.Namespace) -> int:
    link = LinkRequest.from_flags(False if args.no_network else None, args.bandwidth, args.latency)
    if args.no_emulation and link.network:
        raise UserError(
            "--bandwidth/--latency: emulated links need device emulation; drop --no-emulation"
        )
    cluster = link.apply(load_cluster(args.cluster))
    shape = shape_for(
        args.model, args.batch_size, args.seq_len, args.lora_rank, args.gradient_checkpointing
    )
    context = measurement_context(
        cluster,
        emulate=not args.no_emulation,
        cpu_period_us=DEFAULT_CPU_PERIOD_US,
        network=link.network,
    )
    keys = [profile_key(c, shape) for c in context]
    t0 = time.perf_counter()
    profiles = None if args.no_cache else load_cached(keys)
    cached = profiles is not None
    if profiles is None:
        jobs = [(shape, d.memory_bytes, k) for d, k in zip(cluster.devices, keys, strict=True)]
        out = run_on_cluster(
            profile_worker, jobs, cluster, emulate=not args.no_emulation, network=link.network
        )
        profiles = [DeviceProfile.from_dict(d) for d in out]
        store_cached(profiles)
    meta = {
        "model": args.model,
        "batch_size": shape.batch_size,
        "seq_len": shape.seq_len,
        "mlp_chunk": shape.mlp_chunk,
        "vocab_chunk": shape.vocab_chunk,
        "lora_rank": args.lora_rank,
        "gradient_checkpointing": shape.recompute,
        "cluster": cluster.to_dict(),
    }
    save_profiles(args.out, profiles, meta)
    print(
        f"{len(profiles)} devices {'(cached)' if cached else 'profiled'} in "
        f"{time.perf_counter() - t0:.1f} s -> {args.out}",
        file=sys.stderr,
    )
    for p in profiles:
        curves = ", ".join(
            f"{s} {c.a * 1e3:.1f}+{c.b * 1e3:.2f}·u ms" for s, c in p.segments.items()
        )
        print(
            f"  {p.name}: {curves}; replicated {p.replicated_s * 1e3:.1f} ms; "
            f"all-reduce {p.allreduce_s * 1e3:.2f} ms"
        )
    if len(profiles) > 1:  # the group's (profiler/overlap.py)
        loss = profiles[0].overlap_loss
        print(f"  an all-reduce overlapped with computing: {loss:.2f} of it not hidden")
    return 0
