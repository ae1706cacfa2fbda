"""``xronos bench``: every strategy on the same emulated cluster, interleaved (docs/cli.md)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from xronos.bench import crossover
from xronos.bench.crossover import EXAMPLE, parse_links
from xronos.bench.report import build_report, write_outputs
from xronos.bench.scenarios import SCENARIOS, Scenario, get_scenario
from xronos.bench.worker import BenchJob, BenchOutput, bench_worker
from xronos.cli.common import add_comm_dtype_arg, add_link_args
from xronos.emulation import load_cluster
from xronos.emulation.cluster import LinkRequest
from xronos.errors import UserError
from xronos.metrics import format_bench_table
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import default_mlp_chunk, default_vocab_chunk
from xronos.profiler.measure import Shape
from xronos.profiler.run import load_cached, profile_key, store_cached
from xronos.run.launch import CPU_LIMITS, fastest_device, measurement_context, run_on_cluster
from xronos.run.opening import SessionSpec
from xronos.run.sessions import ProfileSource
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource

ALL = ("auto", "xronos", "tp-even", "pp-gpipe", "pp-1f1b", "single")
"""The default strategies, in the order they take turns and are tabled."""
CHECKPOINT_LORA_RANK = 8
"""LoRA rank of a ``--model`` checkpoint without ``--lora-rank`` (as ``xronos finetune``)."""
MECHANISMS = ("cpu limit", "cpu sets", "memory cap", "network")
"""The report's lines that say which mechanism emulates what (kept in ``bench.json``)."""


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare strategies on one emulated cluster")
    p.add_argument("--scenario", default="ci-2dev", help=f"one of {', '.join(SCENARIOS)}")
    p.add_argument(
        "--cluster",
        help="run the scenario's workload on this cluster instead (preset or TOML file)",
    )
    p.add_argument("--out", default="runs/bench", help="output directory (default: %(default)s)")
    p.add_argument(
        "--model",
        help="preset, Hugging Face model directory or .gguf file to run instead of the "
        "scenario's model",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        help="LoRA rank (0: full fine-tuning); default: the scenario's for a preset, "
        f"{CHECKPOINT_LORA_RANK} for a --model directory or .gguf file",
    )
    p.add_argument(
        "--strategies", default=",".join(ALL), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--batch-size", type=int, help="sequences a step (scenario default)")
    p.add_argument("--seq-len", type=int, help="tokens a sequence (scenario default)")
    p.add_argument("--steps", type=int, help="counted steps per strategy (scenario default)")
    p.add_argument("--warmup", type=int, help="uncounted steps per strategy (scenario default)")
    p.add_argument("--no-cache", action="store_true", help="re-profile even if cached")
    add_comm_dtype_arg(p)
    p.add_argument(
        "--overlap",
        action="store_true",
        help="tensor parallelism runs each batch as two halves at once, one computing while "
        "the other's all-reduce is in flight",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="every block keeps only its inputs and computes the rest again in backward",
    )
    p.add_argument("--no-emulation", action="store_true", help="run without device limits")
    add_link_args(p)
    p.add_argument(
        "--links",
        metavar="LINK,...",
        help="run the whole bench once per link, every device on it: loopback or a rate, "
        f"e.g. {EXAMPLE}; writes OUT/<link>/ and the crossover map OUT/crossover.json, .png",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument(
        "--cpu-period-ms",
        type=float,
        default=10.0,
        help="CFS period of the emulated CPU quota (default: %(default)s ms)",
    )
    p.add_argument(
        "--cpu-limit",
        choices=CPU_LIMITS,
        default="auto",
        help="how a slow device is made slow: a competing real-time load on its own CPUs "
        "(load), a CFS quota (quota), SIGSTOP/SIGCONT (duty-cycle); auto: load where "
        "possible, else quota, else duty-cycle (default: %(default)s)",
    )
    p.set_defaults(run=run)


def parse_strategies(text: str) -> tuple[Strategy, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise UserError(f"--strategies: none given; choose from {', '.join(ALL)}")
    return tuple(Strategy.parse(n, flag="--strategies") for n in names)


def workload(args: argparse.Namespace) -> tuple[Scenario, ModelSource]:
    """The scenario with the command line's overrides (batch shape, steps, warmup, model,
    LoRA rank), and where its model's weights come from; checks them (one-line
    UserErrors)."""
    scenario = get_scenario(args.scenario)
    steps = args.steps if args.steps is not None else scenario.steps
    warmup = args.warmup if args.warmup is not None else scenario.warmup
    if steps < 1 or warmup < 0:
        raise UserError("--steps must be ≥ 1 and --warmup ≥ 0")
    batch = args.batch_size if args.batch_size is not None else scenario.batch_size
    seq = args.seq_len if args.seq_len is not None else scenario.seq_len
    if batch < 1 or seq < 2:
        raise UserError("--batch-size must be ≥ 1 and --seq-len ≥ 2")
    model = args.model if args.model is not None else scenario.model
    if args.lora_rank is not None and args.lora_rank < 0:
        raise UserError(f"--lora-rank must be ≥ 1, or 0 for full fine-tuning; got {args.lora_rank}")
    probe = ModelSource.from_name(model)
    if seq > probe.cfg.max_position_embeddings:
        raise UserError(
            f"--seq-len {seq} exceeds the model's context of "
            f"{probe.cfg.max_position_embeddings} tokens; lower --seq-len"
        )
    rank = scenario.lora_rank
    if args.lora_rank is not None:
        rank = args.lora_rank
    elif args.model is not None and probe.model_dir is not None:
        rank = CHECKPOINT_LORA_RANK  # a checkpoint: LoRA, as xronos finetune
    scenario = replace(scenario, steps=steps, warmup=warmup, model=model, lora_rank=rank)
    scenario = replace(scenario, batch_size=batch, seq_len=seq)
    lora = LoRAConfig(r=rank) if rank else None
    return scenario, replace(probe, lora=lora, recompute=args.gradient_checkpointing)


def run(args: argparse.Namespace) -> int:
    scenario, source = workload(args)
    strategies = parse_strategies(args.strategies)
    if args.links is not None:
        return sweep(args, scenario, source, strategies)
    link = LinkRequest.from_flags(False if args.no_network else None, args.bandwidth, args.latency)
    bench_once(args, scenario, source, strategies, link, Path(args.out))
    return 0


def sweep(
    args: argparse.Namespace,
    scenario: Scenario,
    source: ModelSource,
    strategies: tuple[Strategy, ...],
) -> int:
    """``--links``: one whole bench run per link, then the crossover map (everything is
    checked before the first run starts)."""
    if args.bandwidth is not None or args.no_network:
        flag = "--bandwidth" if args.bandwidth is not None else "--no-network"
        raise UserError(
            f"--links gives every device each link in turn and {flag} fixes one; drop "
            f"{flag}, or put loopback or the rate in --links"
        )
    links = parse_links(args.links, args.latency)
    if args.no_emulation and any(link.bandwidth_bps for link in links):
        raise UserError(
            "--links: emulated links need device emulation; drop --no-emulation, or give "
            "--links loopback only"
        )
    load_cluster(args.cluster or scenario.cluster)  # a bad --cluster stops before any run
    out = Path(args.out)
    crossover.clear_outputs(out)
    benches = []
    for i, link in enumerate(links, 1):
        print(f"bench --links: {link.label} ({i} of {len(links)})", file=sys.stderr)
        benches.append(
            bench_once(args, scenario, source, strategies, link.request(), out / link.label)
        )
    meta = {"cluster": args.cluster or scenario.cluster, "command": _command()}
    doc = crossover.crossover(links, benches, meta)
    crossover.write_outputs(out, doc)
    print(crossover.format_table(doc), end="")
    print(f"wrote {out}/crossover.json, crossover.png and one directory per link")
    return 0


def _command() -> str:
    return "xronos " + " ".join(sys.argv[1:]) if sys.argv else ""


def _mechanisms(lines: list[str]) -> dict[str, str]:
    """The report's mechanism lines, e.g. ``{"network": "namespaces + veth + …"}``."""
    out: dict[str, str] = {}
    for line in lines:
        key, _, rest = line.partition(": ")
        if key in MECHANISMS and rest:
            out[key] = f"{out[key]}; {rest}" if key in out else rest
    return out


def bench_once(
    args: argparse.Namespace,
    scenario: Scenario,
    source: ModelSource,
    strategies: tuple[Strategy, ...],
    link: LinkRequest,
    out_dir: Path,
) -> dict[str, Any]:
    """One bench run on ``link``: writes ``out_dir``/bench.json, bench.png, trace.json,
    prints the table and returns the ``bench.json`` document."""
    cluster = link.apply(load_cluster(args.cluster or scenario.cluster))
    cfg = source.cfg
    shape = Shape(
        cfg=cfg,
        batch_size=scenario.batch_size,
        seq_len=scenario.seq_len,
        mlp_chunk=default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk=default_vocab_chunk(cfg.vocab_size),
        lora=source.lora,
        recompute=source.recompute,
    )
    context = measurement_context(
        cluster,
        emulate=not args.no_emulation,
        cpu_period_us=int(args.cpu_period_ms * 1000),
        cpu_limit=args.cpu_limit,
        network=link.network,
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
            overlap=args.overlap,
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
    print(f"model {scenario.model}: {_training(source)}", file=sys.stderr)
    t0 = time.perf_counter()
    emulation: dict[str, Any] = {}
    report: list[str] = []

    def say(line: str) -> None:
        report.append(line)
        print(line, file=sys.stderr)

    results = run_on_cluster(
        bench_worker,
        [job] * cluster.world_size,
        cluster,
        emulate=not args.no_emulation,
        network=link.network,
        timeout_s=args.timeout,
        cpu_period_us=int(args.cpu_period_ms * 1000),
        cpu_limit=args.cpu_limit,
        report=say,
        emulation=emulation,
    )
    if emulation:
        emulation["mechanisms"] = _mechanisms(report)
    out: BenchOutput = results[0]
    if cached is None:
        store_cached(out.measured)
    # profiling runs first (every strategy's memory need is predicted from it), so the
    # opening of xronos that follows times its planning and calibration alone
    prep_s = out.profile_s + out.planning_s
    meta = {
        "command": _command(),
        "workload": _workload_record(scenario, source),
        "profile_cached": cached is not None,
        "profiling_and_planning_s": prep_s,
        "profiling_s": out.profile_s,
        "wall_s": time.perf_counter() - t0,
        "emulation": emulation or None,
        "links": [
            {"name": d.name, "bandwidth_bps": d.bandwidth_bps, "latency_s": d.latency_s}
            for d in cluster.devices
        ],
    }
    result = build_report(out, scenario, cluster, cfg, job.fastest, meta)
    for name, when in result["io_threads_restored"].items():
        if when is not None:
            say(
                f"device {name}: gloo I/O threads back in the normal class ({when}): another "
                "program kept the CPU; its messages wait for the scheduler's tick from then on"
            )
    write_outputs(result, out_dir, out)
    print(format_bench_table(result))
    if spread := interval_line(result):
        print(spread)
    if speeds := result.get("solo_speed"):
        print(
            "speeds during the run (solo step against the fastest device's; asked): "
            + ", ".join(f"{n} {v['measured']:.2f} ({v['asked']:.2f})" for n, v in speeds.items())
        )
    if together := result.get("contention"):
        print(together_line(result, together))
    ideal = result["ideal_step_time_s"]
    print(
        (f"ideal step time {ideal:.3f} s; " if ideal else "ideal step time unknown; ")
        + f"profiling+planning {prep_s:.1f} s (profiling {out.profile_s:.1f} s"
        + f"{', cached' if cached else ''}); wrote {out_dir}/bench.json, bench.png"
    )
    return result


def interval_line(result: dict[str, Any]) -> str | None:
    """Each strategy's speed-up over ``single`` with its 95 % interval over resampled
    rounds (:mod:`xronos.bench.spread`), and ``auto``'s step over the best other's with
    its own; None where no strategy has one."""
    parts = [
        f"{n} {e['speedup_vs_single']:.2f}x ({lo:.2f}-{hi:.2f})"
        for n, e in result["strategies"].items()
        if n != "single" and e.get("speedup_vs_single_interval")
        for lo, hi in [e["speedup_vs_single_interval"]]
    ]
    against = result.get("auto_vs_best_other") or {}
    if against.get("interval"):
        lo, hi = against["interval"]
        parts.append(
            f"auto {against['ratio']:.3f} x the best other ({against['best_other']}, "
            f"{lo:.3f}-{hi:.3f})"
        )
    if not parts:
        return None
    return "x single, 95 % interval over the rounds resampled: " + ", ".join(parts)


def together_line(result: dict[str, Any], contention: dict[str, float]) -> str:
    """Solo steps of every device at the same moment against in turn, the compute bound
    with every device busy, and each strategy's efficiency against it."""
    per = ", ".join(f"{n} {c * 100:+.1f} %" for n, c in contention.items())
    eff = ", ".join(
        f"{n} {e['efficiency_together'] * 100:.1f} %"
        for n, e in result["strategies"].items()
        if e.get("efficiency_together") is not None
    )
    return (
        f"every device computing at once (solo steps together against in turn): {per}; "
        f"ideal step time then {result['ideal_together_step_time_s']:.3f} s, "
        f"efficiency against it: {eff}"
    )


def _training(source: ModelSource) -> str:
    return f"LoRA r={source.lora.r}" if source.lora else "full fine-tuning"


def _workload_record(scenario: Scenario, source: ModelSource) -> dict[str, Any]:
    """What ran, for ``bench.json``: the model as given and as resolved, how it was
    trained, and the batch shape."""
    cfg = source.cfg
    return {
        "model": scenario.model,
        "model_path": source.model_dir,
        "preset": source.model_dir is None,
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "training": "lora" if source.lora else "full",
        "gradient_checkpointing": source.recompute,
        "lora_rank": source.lora.r if source.lora else None,
        "batch_size": scenario.batch_size,
        "seq_len": scenario.seq_len,
    }
