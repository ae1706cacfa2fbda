"""``xronos bench`` inside the workers: every strategy on the same processes, interleaved.

All strategies live in the same device processes (so in the same emulated limits) and
take turns step by step, each round in the order of a Williams design
(:func:`~xronos.run.rounds.round_order`), so that drift of the machine hits all of them
alike and no strategy always follows the same one. Each strategy's step is the loop's own
:func:`run_step` on the strategy's session; it starts after a barrier that is not timed.
``single`` runs the whole model on the fastest device while the others wait.

A multi-device step ends with one more, timed collective (``step.end``): in a real run
the next step's first collective is where a device that finished its optimizer update
early waits for the others; here the untimed barrier between strategies would hide that
wait, so ``step.end`` puts it back, as idle, in the step it belongs to.

Every device also runs the whole model alone, inside its own limits, once per round
(``solo``): its median counted step is ``T_i^solo`` (docs/architecture.md, Measurement),
measured, not extrapolated (the fastest device's is the ``single`` strategy's when that
runs). Where every device can hold the model, each counted round also times all the solo
steps at the same moment: devices emulated on one host slow each other down through its
shared caches and memory, and the bound with every device busy
(``ideal_together_step_time_s``) shows how much.

A calibrated heterogeneous tensor-parallel session (``xronos``, or ``auto`` where it ran
one) is watched in the warm-up as ``xronos finetune`` watches it: once its first steps are
in, the plan's balance is checked against them and the session moves to a better-balanced
plan where that pays (:class:`~xronos.run.rebalance.Rebalancer`; ``rebalanced`` in
``bench.json``). The counted steps keep the plan they start with.

After the timed rounds each session replays its last step's compute with no
communication in flight (:meth:`~xronos.train.session.Session.isolated_compute`), for
the computation-stall ratio.

Memory (:mod:`xronos.bench.memory`): before anything runs, each device measures its
runtime and every strategy's need is predicted from the profiles; a strategy whose plan
cannot fit the devices' caps is reported infeasible, with the reason, and never opened.
When some capped device could not hold all the others' parts at once, the strategies take
turns instead of interleaving: each is opened, run for all its steps and closed, its
memory released before the next opens (every strategy sees the same batches all the
same), and its peak covers its whole turn, opening included. Taking turns, a
tensor-parallel session skips the stall measurement (its twin would double the shard),
and ``auto``'s trials hold one candidate at a time; the solo steps run last, on the devices
that can hold the whole model.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from xronos.bench.memory import (
    Verdict,
    plan_from_dict,
    plan_needs,
    take_turns,
    verdicts,
)
from xronos.bench.progress import Progress
from xronos.bench.solo import median_or_none
from xronos.bench.steps import BenchJob, Run, StrategyLog, times_together
from xronos.comm.iothreads import restored
from xronos.comm.launch import WorkerContext
from xronos.metrics.rss import (
    MIB,
    PeakRSS,
    cgroup_peak,
    enforced_cap,
)
from xronos.planner.auto import AutoChoice, plan_auto
from xronos.planner.memory import tp_need, within_caps
from xronos.planner.plan import Plan, segment_units
from xronos.planner.profile import DeviceProfile, on_the_wire
from xronos.planner.solve import predict
from xronos.run.opening import wire_bytes
from xronos.run.sessions import Profiles
from xronos.train.session import Strategy

__all__ = ["BenchJob", "BenchOutput", "StrategyLog", "bench_worker"]


@dataclass
class BenchOutput:
    """Rank 0's result of a bench run."""

    logs: dict[Strategy, StrategyLog]
    """The strategies that ran (an infeasible one has none)."""
    measured: list[DeviceProfile]
    """Profiles as measured (or read from the cache): what the cache keeps."""
    calibrated: list[DeviceProfile]
    """Profiles after the xronos plan's calibration (the measured ones without it)."""
    planning_s: float
    """Profiling + planning + calibration of the xronos strategy."""
    profile_s: float
    peak_rss_mb: list[float]
    """Per device: the process's lifetime peak (every strategy and the solo steps)."""
    solo_step_time_s: list[float | None]
    """Per device: median counted step running the whole model alone (None: not run)."""
    solo_together_step_time_s: list[float | None] = field(default_factory=list)
    """Per device: the same, with every device's solo step at the same moment (None: not
    run; empty: not measured)."""
    predicted_step_time_s: dict[Strategy, float | None] = field(default_factory=dict)
    """What the planner's model (communication included) predicted for each strategy."""
    auto: dict[str, object] | None = None
    """``auto``'s candidates, its pick (``chosen``) and what ran."""
    strategy_peak_mb: dict[Strategy, list[float]] = field(default_factory=dict)
    """Per strategy that ran, per device: peak resident memory during its steps (taking
    turns: during its whole turn)."""
    strategy_start_mb: dict[Strategy, list[float]] = field(default_factory=dict)
    """Per strategy that ran, per device: resident memory as it began (what earlier turns
    left behind shows here)."""
    predicted_memory_mb: dict[Strategy, list[float] | None] = field(default_factory=dict)
    """Per strategy, per device: the memory model's resident memory (runtime included)."""
    infeasible: dict[Strategy, str] = field(default_factory=dict)
    """Strategies not run because their plan cannot fit the caps, and why."""
    memory: dict[str, object] = field(default_factory=dict)
    """Runtime, caps (requested and enforced), schedule and how peaks were measured."""
    strategies: tuple[Strategy, ...] = ()
    """Every strategy asked for, in order (run or not)."""
    io_restored: list[str | None] = field(default_factory=list)
    """Per device: when its gloo I/O threads went back to the normal class (after which
    strategy's step), or None: they stayed idle-class (:mod:`xronos.comm.iothreads`)."""


@dataclass
class _Memory:
    """What every rank decided about memory before the strategies run."""

    caps: list[int | None]
    runtime: list[int]
    """Per device: resident bytes of its process with no model alive."""
    enforced: list[int | None]
    """Per device: the cap the kernel enforces on its process."""
    profiles: list[DeviceProfile] | None
    """The measured profiles with each cap less the runtime as usable memory."""
    choice: AutoChoice | None
    found: dict[Strategy, Verdict]
    solo: list[bool]
    """Per device: whether it can run the whole model alone."""
    in_turn: bool


def _memory_setup(ctx: WorkerContext, job: BenchJob, profiles: Profiles) -> _Memory:
    """Profile, measure every device's runtime, predict each strategy's need (collective)."""
    cfg, shape = job.spec.source.cfg, job.spec.shape
    caps = list(job.profiles.memory_caps)
    planned = set(job.strategies) - {Strategy.SINGLE, Strategy.TP_EVEN}
    measured = profiles.get() if planned or any(c is not None for c in caps) else None
    runtime = profiles.process_runtime()
    enforced = list(ctx.group.gather_object(enforced_cap()))
    n = ctx.world_size
    if measured is None:
        found = {s: Verdict(None) for s in job.strategies}
        return _Memory(caps, runtime, enforced, None, None, found, [True] * n, False)
    view = within_caps(measured, caps, runtime)
    choice = plan_auto(
        cfg,
        on_the_wire(view, wire_bytes(job.spec.comm_dtype)),
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        grad_accum=job.spec.grad_accum,
        mlp_chunk=shape.mlp_chunk,
        vocab_chunk=shape.vocab_chunk,
    )
    totals = segment_units(cfg, shape.mlp_chunk, shape.vocab_chunk)
    found = verdicts(job.strategies, choice, cfg, view, totals, caps, runtime, job.fastest)
    whole = [tp_need(p, totals) for p in view]
    solo = [c is None or rt + w <= c for c, rt, w in zip(caps, runtime, whole, strict=True)]
    single = Strategy.SINGLE in job.strategies and found[Strategy.SINGLE].feasible
    together = times_together(job, solo)  # then the fastest holds a solo model beside single
    solo_bytes = [
        w if ok and job.solo and (together or not (single and r == job.fastest)) else 0
        for r, (w, ok) in enumerate(zip(whole, solo, strict=True))
    ]
    in_turn = take_turns(found, caps, runtime, solo_bytes)
    return _Memory(caps, runtime, enforced, view, choice, found, solo, in_turn)


def bench_worker(ctx: WorkerContext, job: BenchJob) -> BenchOutput | None:
    progress = Progress(ctx.rank)
    profiles = Profiles(ctx, job.spec.shape, job.profiles)
    mem = _memory_setup(ctx, job, profiles)
    if profiles.measured is not None:
        fresh = job.profiles.cached is None
        progress.say(f"profiled in {profiles.seconds:.1f} s" if fresh else "profiles cached")
    view = mem.profiles
    get: Callable[[], list[DeviceProfile]] = profiles.get if view is None else lambda: view
    runs = tuple(s for s in job.strategies if mem.found[s].feasible)
    peak = PeakRSS()
    run = Run(job, ctx, get, peak, {s: StrategyLog() for s in runs}, progress)
    schedule = run.in_turn if mem.in_turn else run.interleaved
    solo_times = schedule(runs, mem.solo)
    peaks = ctx.group.gather_object(dict(run.peaks))
    starts = ctx.group.gather_object(dict(run.starts))
    lifetime = ctx.group.gather_object(peak.overall_bytes() / MIB)
    charged = ctx.group.gather_object(cgroup_peak())
    if run.io_restored is None and restored():
        run.io_restored = "outside the strategies' steps: profiling, opening or solo steps"
    io_restored = ctx.group.gather_object(run.io_restored)
    if ctx.rank != 0:
        return None
    measured = profiles.measured or []
    calibrated = run.calibrated or view or measured
    return BenchOutput(
        logs=run.logs,
        measured=measured,
        calibrated=calibrated,
        planning_s=run.planning_s,
        profile_s=profiles.seconds,
        peak_rss_mb=lifetime,
        solo_step_time_s=solo_medians(solo_times.alone, run.logs, job),
        solo_together_step_time_s=[median_or_none(t) for t in solo_times.together],
        predicted_step_time_s=predictions(job, mem.choice, view or measured, run.logs, run.auto),
        auto=run.auto,
        strategy_peak_mb={s: [p[s] / MIB for p in peaks] for s in runs},
        strategy_start_mb={s: [p[s] / MIB for p in starts] for s in runs},
        predicted_memory_mb=_predicted_memory(job, mem, run.logs, view),
        infeasible={s: v.reason for s, v in mem.found.items() if not v.feasible},
        memory={
            "runtime_mb": [b / MIB for b in mem.runtime],
            "cap_mb": [None if c is None else c / MIB for c in mem.caps],
            "enforced_cap_mb": [None if c is None else c / MIB for c in mem.enforced],
            "schedule": "in turn" if mem.in_turn else "interleaved",
            "peak_rss": peak.note,
            "peak_scope": (
                "each strategy's own (freed memory handed back before each turn)"
                if mem.in_turn
                else "the process's while the strategy ran (freed memory stays resident)"
            ),
            "cgroup_peak_mb": [None if b is None else b / MIB for b in charged],
        },
        strategies=job.strategies,
        io_restored=io_restored,
    )


def solo_medians(
    times: list[list[float]], logs: dict[Strategy, StrategyLog], job: BenchJob
) -> list[float | None]:
    out = [median_or_none(t) for t in times]
    single = logs.get(Strategy.SINGLE)
    if single is not None and single.records:
        counted = [r[0].duration for r in single.records[single.warmup :] if r]
        out[job.fastest] = statistics.median(counted) if counted else None
    return out


def _predicted_memory(
    job: BenchJob,
    mem: _Memory,
    logs: dict[Strategy, StrategyLog],
    view: list[DeviceProfile] | None,
) -> dict[Strategy, list[float] | None]:
    """Runtime plus the model's part of the plan that ran (of the planned one where the
    strategy did not run)."""
    if view is None:
        return {}
    cfg, shape = job.spec.source.cfg, job.spec.shape
    totals = segment_units(cfg, shape.mlp_chunk, shape.vocab_chunk)
    out: dict[Strategy, list[float] | None] = {}
    for s in job.strategies:
        plan = plan_from_dict(logs[s].plan) if s in logs else None
        need = plan_needs(cfg, view, plan, totals) if plan is not None else mem.found[s].need_bytes
        out[s] = (
            None
            if need is None
            else [(rt + n) / MIB for rt, n in zip(mem.runtime, need, strict=True)]
        )
    return out


def predictions(
    job: BenchJob,
    choice: AutoChoice | None,
    profiles: list[DeviceProfile],
    logs: dict[Strategy, StrategyLog],
    auto: dict[str, object] | None,
) -> dict[Strategy, float | None]:
    """Each strategy's predicted step from the profiles (communication included): the
    planner's own candidates for single, tp-even and the pipelines; for xronos the plan it
    ran (after calibration), predicted from the measured profiles like every other (the
    calibrated ones are fitted to that plan's own passes, not to whole steps); for auto
    what ran — where that was heterogeneous TP, the plan after calibration, as for xronos
    (the candidate's own plan is not the one that ran)."""
    if choice is None:
        return {}
    by_name = {p.name: p for p in on_the_wire(profiles, wire_bytes(job.spec.comm_dtype))}

    def ran_tp(s: Strategy) -> bool:
        """Whether ``s`` ran heterogeneous TP (xronos, or auto's pick of it)."""
        return s in logs and logs[s].plan.get("strategy") == Strategy.XRONOS.value

    def candidate(name: str, devices: tuple[int, ...] | None = None) -> float | None:
        """The best feasible prediction of that kind (the one its session runs)."""
        found = [
            c.predicted_step_s
            for c in choice.candidates
            if c.strategy == name and c.feasible and (devices is None or c.devices == devices)
        ]
        return min(found, default=None)

    out: dict[Strategy, float | None] = {}
    for s in job.strategies:
        if s is Strategy.SINGLE:
            out[s] = candidate("single", (job.fastest,))
        elif s is Strategy.TP_EVEN:
            out[s] = candidate("tp-even")
        elif s is Strategy.HYBRID:
            out[s] = candidate("hybrid")
        elif s.is_pipeline:
            out[s] = candidate("pp-1f1b")
        elif ran_tp(s):  # the plan after calibration, over the devices that ran it
            plan = Plan.from_dict(dict(logs[s].plan))
            out[s] = float(predict(plan, [by_name[d] for d in plan.devices])["step_time_s"])
        elif s is Strategy.AUTO and auto is not None:
            ran = auto["ran"]
            out[s] = ran.get("predicted_step_s") if isinstance(ran, dict) else None
    return out
