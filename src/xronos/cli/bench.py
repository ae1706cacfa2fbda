"""``xronos bench``: every strategy on the same emulated cluster, interleaved (DESIGN §7)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from xronos.bench.report import build_report, write_outputs
from xronos.bench.scenarios import SCENARIOS, get_scenario
from xronos.bench.worker import BenchJob, BenchOutput, bench_worker
from xronos.emulation import load_cluster
from xronos.emulation.cluster import LinkRequest
from xronos.errors import UserError
from xronos.metrics import format_bench_table
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import default_mlp_chunk, default_vocab_chunk
from xronos.profiler.measure import Shape
from xronos.profiler.run import load_cached, profile_key, store_cached
from xronos.run.launch import fastest_device, measurement_context, run_on_cluster
from xronos.run.sessions import ProfileSource, SessionSpec
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource

ALL = ("auto", "xronos", "tp-even", "pp-gpipe", "pp-1f1b", "single")
"""The default strategies, in the order they take turns and are tabled."""


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare strategies on one emulated cluster")
    p.add_argument("--scenario", default="ci-2dev", help=f"one of {', '.join(SCENARIOS)}")
    p.add_argument(
        "--cluster",
        help="run the scenario's workload on this cluster instead (preset or TOML file)",
    )
    p.add_argument("--out", default="runs/bench", help="output directory (default: %(default)s)")
    p.add_argument(
        "--strategies", default=",".join(ALL), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, help="counted steps per strategy (scenario default)")
    p.add_argument("--warmup", type=int, help="uncounted steps per strategy (scenario default)")
    p.add_argument("--no-cache", action="store_true", help="re-profile even if cached")
    p.add_argument(
        "--comm-dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="dtype of the tensor-parallel activation all-reduces (default: %(default)s)",
    )
    p.add_argument("--no-emulation", action="store_true", help="run without device limits")
    p.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="give every device a link of this bandwidth, e.g. 1Gbit, 200Mbit (network on)",
    )
    p.add_argument(
        "--latency",
        metavar="T",
        help="give every device a link of this one-way latency, e.g. 2ms (network on)",
    )
    p.add_argument(
        "--no-network",
        action="store_true",
        help="do not emulate the links the cluster declares (devices talk over loopback)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument(
        "--cpu-period-ms",
        type=float,
        default=10.0,
        help="CFS period of the emulated CPU quota (default: %(default)s ms)",
    )
    p.set_defaults(run=run)


def parse_strategies(text: str) -> tuple[Strategy, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise UserError(f"--strategies: none given; choose from {', '.join(ALL)}")
    return tuple(Strategy.parse(n, flag="--strategies") for n in names)


def run(args: argparse.Namespace) -> int:
    scenario = get_scenario(args.scenario)
    if args.steps is not None or args.warmup is not None:
        from dataclasses import replace

        scenario = replace(
            scenario,
            steps=args.steps if args.steps is not None else scenario.steps,
            warmup=args.warmup if args.warmup is not None else scenario.warmup,
        )
    if scenario.steps < 1 or scenario.warmup < 0:
        raise UserError("--steps must be ≥ 1 and --warmup ≥ 0")
    strategies = parse_strategies(args.strategies)
    link = LinkRequest.from_flags(False if args.no_network else None, args.bandwidth, args.latency)
    cluster = link.apply(load_cluster(args.cluster or scenario.cluster))
    source = ModelSource.from_name(scenario.model)
    lora = LoRAConfig(r=scenario.lora_rank) if scenario.lora_rank else None
    cfg = source.cfg
    shape = Shape(
        cfg=cfg,
        batch_size=scenario.batch_size,
        seq_len=scenario.seq_len,
        mlp_chunk=default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk=default_vocab_chunk(cfg.vocab_size),
        lora=lora,
    )
    context = measurement_context(
        cluster, emulate=not args.no_emulation, cpu_period_us=int(args.cpu_period_ms * 1000)
    )
    keys = tuple(profile_key(c, shape) for c in context)
    cached = None if args.no_cache else load_cached(list(keys))
    job = BenchJob(
        spec=SessionSpec(
            source=source,
            strategy=Strategy.XRONOS,
            optim=OptimConfig(lr=1e-4),
            shape=shape,
            comm_dtype=args.comm_dtype,
        ),
        strategies=strategies,
        steps=scenario.steps,
        warmup=scenario.warmup,
        profiles=ProfileSource(
            memory_caps=tuple(d.memory_bytes for d in cluster.devices),
            keys=keys,
            cached=tuple(cached) if cached else None,
        ),
        fastest=fastest_device(cluster),
    )
    print(f"bench {scenario.name}: {scenario.description}", file=sys.stderr)
    t0 = time.perf_counter()
    emulation: dict[str, Any] = {}
    results = run_on_cluster(
        bench_worker,
        [job] * cluster.world_size,
        cluster,
        emulate=not args.no_emulation,
        network=link.network,
        timeout_s=args.timeout,
        cpu_period_us=int(args.cpu_period_ms * 1000),
        emulation=emulation,
    )
    out: BenchOutput = results[0]
    if cached is None:
        store_cached(out.measured)
    meta = {
        "command": "xronos " + " ".join(sys.argv[1:]) if sys.argv else "",
        "profile_cached": cached is not None,
        "profiling_and_planning_s": out.planning_s,
        "profiling_s": out.profile_s,
        "wall_s": time.perf_counter() - t0,
        "emulation": emulation or None,
        "links": [
            {"name": d.name, "bandwidth_bps": d.bandwidth_bps, "latency_s": d.latency_s}
            for d in cluster.devices
        ],
    }
    result = build_report(out, scenario, cluster, cfg, job.fastest, meta)
    write_outputs(result, Path(args.out), out)
    print(format_bench_table(result))
    ideal = result["ideal_step_time_s"]
    print(
        (f"ideal step time {ideal:.3f} s; " if ideal else "ideal step time unknown; ")
        + f"profiling+planning {out.planning_s:.1f} s (profiling {out.profile_s:.1f} s"
        + f"{', cached' if cached else ''}); wrote {args.out}/bench.json, bench.png"
    )
    return 0
