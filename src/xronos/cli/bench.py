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
from xronos.errors import UserError
from xronos.metrics import format_bench_table
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import default_mlp_chunk, default_vocab_chunk
from xronos.profiler.measure import Shape
from xronos.profiler.run import load_cached, profile_key, store_cached
from xronos.run.launch import fastest_device, run_on_cluster
from xronos.run.sessions import ProfileSource, SessionSpec
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource

ALL = ("xronos", "tp-even", "pp-gpipe", "pp-1f1b", "single")
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
    p.add_argument("--no-emulation", action="store_true", help="run without device limits")
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
    cluster = load_cluster(args.cluster or scenario.cluster)
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
    keys = tuple(profile_key(d.to_dict(), shape) for d in cluster.devices)
    cached = None if args.no_cache else load_cached(list(keys))
    job = BenchJob(
        spec=SessionSpec(
            source=source, strategy=Strategy.XRONOS, optim=OptimConfig(lr=1e-4), shape=shape
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
    results = run_on_cluster(
        bench_worker,
        [job] * cluster.world_size,
        cluster,
        emulate=not args.no_emulation,
        timeout_s=args.timeout,
        cpu_period_us=int(args.cpu_period_ms * 1000),
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
    }
    result = build_report(out, scenario, cluster, cfg, job.fastest, meta)
    write_outputs(result, Path(args.out), out)
    print(format_bench_table(result))
    print(
        f"ideal step time {result['ideal_step_time_s']:.3f} s; profiling+planning "
        f"{out.planning_s:.1f} s (profiling {out.profile_s:.1f} s"
        f"{', cached' if cached else ''}); wrote {args.out}/bench.json, bench.png"
    )
    return 0
