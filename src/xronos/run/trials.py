"""``auto`` on the devices: predict every candidate, measure the best few, open the
fastest measured one. A heterogeneous tensor-parallel candidate whose trial steps call for
another plan gets that plan tried too (:mod:`xronos.run.refine`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeGuard

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.planner.auto import Candidate, plan_auto
from xronos.planner.calibrate import segment_times
from xronos.planner.hybrid import NO_HYBRID
from xronos.planner.memory import tp_need
from xronos.planner.plan import Plan, segment_units
from xronos.planner.profile import DeviceProfile, on_the_wire
from xronos.run.opening import Opened, SessionSpec, open_candidate, wire_bytes
from xronos.run.refine import Refinement, StepTimes, refine
from xronos.run.rounds import round_order
from xronos.train.batches import Batch
from xronos.train.session import Session, Strategy
from xronos.train.tp import TPSession

SHORTLIST = 3
"""How many of the best-predicted candidates ``auto`` measures before it chooses."""
CLOSE = 0.10
"""Interleaved trials go on while the two fastest candidates are this close: on a host
whose speed strays by 10–30 % over seconds, four steps each picked the wrong one of two
candidates 8–10 % apart."""
MORE_ROUNDS = 3
"""At most this many times the trial steps, timed, when the candidates stay close."""
ALONE_MARGIN = 0.03
"""A collaboration wins over the fastest device alone only when its trial is at least this
much faster: closer than that, trials cannot tell the two apart on a host whose speed
strays (measured on ``ci-2dev`` at 500 Mbit/s: ``xronos`` 2 % ahead in the trials, 6 %
behind in the counted steps), and the promise is never to be slower than one device alone;
alone, the other devices also stay free."""

_NONE = {
    "hybrid": NO_HYBRID,
    "pp-1f1b": "no stage split fits the devices' memory",
}
"""Why ``only``'s kind has no candidate at all, when the planner gave none."""

Tried = tuple[Plan | None, list[DeviceProfile]]
"""A trial's plan (an xronos plan, calibrated) and calibrated profiles, kept for the winner."""


def _key(c: Candidate) -> str:
    return f"{c.strategy}:{','.join(map(str, c.devices))}"


def open_auto(
    spec: SessionSpec,
    ctx: WorkerContext,
    group: TPGroup,
    profiles: Callable[[], list[DeviceProfile]],
    first: list[Batch],
    only: str | None = None,
) -> Opened:
    """Predict every candidate (:func:`~xronos.planner.auto.plan_auto`), then *measure*
    the best few — each opened fresh on its devices, one untimed and ``spec.trial_steps``
    timed steps on the first batch, then discarded; all open at once and stepped in turn
    where the devices' memory holds them together, else one after the other — and open
    the fastest measured one (:func:`pick`: a collaboration must beat the device alone by
    :data:`ALONE_MARGIN`); the devices it leaves out get no session. Predictions from a
    profile can be off by tens of percent; a real step cannot. With ``only`` (``pp-1f1b``:
    the best pipeline, run with ``spec.strategy``'s schedule) the best-predicted candidate
    of that kind runs, untried."""
    t0 = time.perf_counter()
    cfg, shape, measured = spec.source.cfg, spec.shape, profiles()
    choice = plan_auto(
        cfg,
        on_the_wire(measured, wire_bytes(spec.comm_dtype)),
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        grad_accum=spec.grad_accum,
        mlp_chunk=shape.mlp_chunk,
        vocab_chunk=shape.vocab_chunk,
    )
    runnable = [
        c
        for c in choice.candidates
        if c.feasible
        and (only is None or c.strategy == only)
        and (spec.anchor is None or spec.anchor in c.devices)
    ]
    if not runnable and only is not None:
        why = next((c.why for c in choice.candidates if c.strategy == only), "")
        raise UserError(
            f"{only}: no plan of this kind for these devices ({why or _NONE.get(only, '')}); "
            "use --strategy auto"
        )
    if not runnable:
        raise UserError("auto: no strategy fits the devices' memory; add memory or devices")
    ranked = sorted(runnable, key=lambda c: c.predicted_step_s)
    shortlist = ranked[:SHORTLIST] if only is None else ranked[:1]
    steps: dict[str, list[float]] = {}
    tried: dict[str, Tried] = {}
    refined: list[Refinement] = []
    rounds: dict[str, list[float]] | None = None
    if len(shortlist) > 1 and spec.trial_steps > 0:
        totals = segment_units(cfg, shape.mlp_chunk, shape.vocab_chunk)
        run = _interleaved if room_for_all(measured, shortlist, totals) else _one_by_one
        steps, tried, refined = run(spec, ctx, shortlist, measured, first)
        rounds = steps if run is _interleaved else None  # one race's steps, round by round
    trials = {key: statistics.median(ts) for key, ts in steps.items()}
    best, check = pick(shortlist, trials, rounds)
    plan, calibrated = tried.get(_key(best), (None, []))
    session, fresh = open_candidate(spec, ctx, best, measured, first, plan)
    return Opened(
        session,
        time.perf_counter() - t0,
        given=False,
        calibrated=calibrated or fresh,
        choice=choice,
        ran=best,
        trial_steps=steps,
        against_alone=check.to_dict() if check is not None else None,
        refined=[r.to_dict() for r in refined],
    )


@dataclass(frozen=True)
class AgainstAlone:
    """The fastest collaboration tried, weighed against the fastest device alone tried."""

    together: str
    """The collaboration (``strategy:ranks``)."""
    alone: str
    """The device alone (``strategy:rank``)."""
    ratio: float
    """The collaboration's step over the device alone's: the median of their rounds' ratios
    where the two stepped in the same rounds (``paired``), else the ratio of their medians."""
    paired: bool

    @property
    def wins(self) -> bool:
        """Whether the collaboration is at least :data:`ALONE_MARGIN` faster."""
        return self.ratio <= 1.0 - ALONE_MARGIN

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"margin": ALONE_MARGIN, "wins": self.wins}


def pick(
    shortlist: Sequence[Candidate],
    trials: dict[str, float],
    rounds: dict[str, list[float]] | None = None,
) -> tuple[Candidate, AgainstAlone | None]:
    """The fastest candidate, measured where it was tried (else predicted); but where a
    collaboration and a device alone were both tried, the fastest collaboration only if it
    beats the fastest device alone by :data:`ALONE_MARGIN`, else that device alone. And that
    weighing (:func:`against_alone`; None where not both kinds were tried)."""
    check = against_alone(shortlist, trials, rounds)
    if check is None:
        return min(shortlist, key=lambda c: trials.get(_key(c), c.predicted_step_s)), None
    wanted = check.together if check.wins else check.alone
    return next(c for c in shortlist if _key(c) == wanted), check


def against_alone(
    shortlist: Sequence[Candidate],
    trials: dict[str, float],
    rounds: dict[str, list[float]] | None = None,
) -> AgainstAlone | None:
    """The fastest tried candidate of several devices against the fastest tried one-device
    candidate; None unless both kinds were tried. With ``rounds`` (every candidate's steps
    of one interleaved race, step *k* of each taken in the same round) the ratio is the
    median of the rounds' ratios: a host that slows for a second or two slows both steps of
    a round, while each candidate's own median may come from another round (replayed on the
    counted steps of past bench runs, the rounds' ratios missed a collaboration at least 5 %
    faster about 40 % less often than the medians' ratio; docs/benchmarks.md)."""
    tried = [c for c in shortlist if _key(c) in trials]
    together = [c for c in tried if len(c.devices) > 1]
    alone = [c for c in tried if len(c.devices) == 1]
    if not together or not alone:
        return None
    a, b = (_key(min(cs, key=lambda c: trials[_key(c)])) for cs in (together, alone))
    x, y = (rounds or {}).get(a, []), (rounds or {}).get(b, [])
    if x and len(x) == len(y):
        ratio = statistics.median(p / q for p, q in zip(x, y, strict=True))
        return AgainstAlone(a, b, ratio, paired=True)
    return AgainstAlone(a, b, trials[a] / trials[b], paired=False)


def _one_by_one(
    spec: SessionSpec,
    ctx: WorkerContext,
    shortlist: Sequence[Candidate],
    measured: list[DeviceProfile],
    first: list[Batch],
) -> tuple[dict[str, list[float]], dict[str, Tried], list[Refinement]]:
    """Each candidate opened, timed and closed before the next is built (memory allows only
    one at a time): an untimed step, then ``spec.trial_steps`` timed ones; a refined plan
    (:mod:`xronos.run.refine`) right after the plan it refines, the same way. Returns each
    candidate's timed steps, its plan and calibrated profiles, and the refinements."""
    steps: dict[str, list[float]] = {}
    tried: dict[str, Tried] = {}
    refined: list[Refinement] = []

    def trial(c: Candidate, plan: Plan | None) -> tuple[list[float], list[StepTimes], Tried]:
        session, calibrated = open_candidate(spec, ctx, c, measured, first, plan)
        timed = [_timed(session, first, ctx) for _ in range(1 + spec.trial_steps)][1:]
        ran = _plan_of(session, ctx)
        if session is not None:
            session.close()  # a trial's memory is gone before the next one is built
        seen = [t for _, t in timed if t is not None]
        return [t for t, _ in timed], seen, (ran, calibrated)

    for c in shortlist:
        key = _key(c)
        steps[key], seen, tried[key] = trial(c, None)
        r = _refinement(spec, c, measured, tried[key][0], seen)
        if r is None:
            continue
        after, _, _ = trial(c, r.after)
        before_s, after_s = statistics.median(steps[key]), statistics.median(after)
        r = replace(r, measured_before_s=before_s, measured_after_s=after_s)
        refined.append(r)
        if r.kept is r.after:
            steps[key], tried[key] = after, (r.after, tried[key][1])
    return steps, tried, refined


def _interleaved(
    spec: SessionSpec,
    ctx: WorkerContext,
    shortlist: Sequence[Candidate],
    measured: list[DeviceProfile],
    first: list[Batch],
) -> tuple[dict[str, list[float]], dict[str, Tried], list[Refinement]]:
    """Every candidate open at once, their steps taken in turn (:func:`_race`). Where a
    heterogeneous tensor-parallel candidate's trial steps call for another plan
    (:mod:`xronos.run.refine`) and the devices' memory holds it beside the others, that
    plan is opened too and every candidate races again; the faster of the candidate's two
    plans stands for it."""
    opened = [open_candidate(spec, ctx, c, measured, first, None) for c in shortlist]
    sessions = [s for s, _ in opened]
    times, seen = _race(spec, ctx, sessions, first)
    plans = [_plan_of(s, ctx) for s in sessions]
    found = [
        (i, r)
        for i, c in enumerate(shortlist)
        if (r := _refinement(spec, c, measured, plans[i], seen[i])) is not None
    ]
    totals = segment_units(spec.source.cfg, spec.shape.mlp_chunk, spec.shape.vocab_chunk)
    more = [*shortlist, *(shortlist[i] for i, _ in found)]
    refined: list[Refinement] = []
    if found and room_for_all(measured, more, totals):
        extra = [
            open_candidate(spec, ctx, shortlist[i], measured, first, r.after) for i, r in found
        ]
        again, _ = _race(spec, ctx, [*sessions, *(s for s, _ in extra)], first)
        times = again[: len(shortlist)]
        for (i, r), after_s in zip(found, again[len(shortlist) :], strict=True):
            r = replace(
                r,
                measured_before_s=statistics.median(times[i]),
                measured_after_s=statistics.median(after_s),
            )
            refined.append(r)
            if r.kept is r.after:
                times[i], plans[i] = after_s, r.after
        for session, _ in extra:
            if session is not None:
                session.close()
    steps = {_key(c): ts for c, ts in zip(shortlist, times, strict=True)}
    tried = {
        _key(c): (plan, calibrated)
        for c, plan, (_, calibrated) in zip(shortlist, plans, opened, strict=True)
    }
    for session, _ in opened:
        if session is not None:
            session.close()
    return steps, tried, refined


def _race(
    spec: SessionSpec,
    ctx: WorkerContext,
    sessions: Sequence[Session | None],
    first: list[Batch],
) -> tuple[list[list[float]], list[list[StepTimes]]]:
    """Steps of every session in turn (rounds in :func:`~xronos.run.rounds.round_order`,
    the first untimed): a host whose speed drifts over seconds slows them alike, where one
    after the other it would favour whichever ran in a quiet moment. While the two best
    are within :data:`CLOSE` of each other, more rounds follow, up to :data:`MORE_ROUNDS`
    times ``spec.trial_steps`` (every rank sees the same times, the slowest rank's, so all
    decide alike). Returns each session's step times and, for a heterogeneous tensor-parallel
    one, what each of its timed steps measured per segment."""
    times: list[list[float]] = [[] for _ in sessions]
    seen: list[list[StepTimes]] = [[] for _ in sessions]
    k = 0
    while k <= spec.trial_steps or (k <= MORE_ROUNDS * spec.trial_steps and _close(times)):
        for i in round_order(len(sessions), k):
            t, segments = _timed(sessions[i], first, ctx)
            if k:
                times[i].append(t)
                if segments is not None:
                    seen[i].append(segments)
        k += 1
    return times, seen


def _close(times: Sequence[Sequence[float]]) -> bool:
    """Whether the two fastest medians so far are within :data:`CLOSE` of each other."""
    a, b = sorted(statistics.median(ts) for ts in times)[:2]
    return b < a * (1.0 + CLOSE)


def room_for_all(
    profiles: Sequence[DeviceProfile], shortlist: Sequence[Candidate], totals: dict[str, int]
) -> bool:
    """Whether every device of the shortlist could hold the whole model once per candidate
    it takes part in (a bound above what any of them needs: no candidate puts more than the
    whole model on a device), within the memory usable there."""
    for r, p in enumerate(profiles):
        count = sum(r in c.devices for c in shortlist)
        if count > 1 and p.memory_bytes > 0 and count * tp_need(p, totals) > p.memory_bytes:
            return False
    return True


def _timed(
    session: Session | None, micro: list[Batch], ctx: WorkerContext
) -> tuple[float, StepTimes | None]:
    """The slowest rank's time for one step of ``session``; every rank of the world takes
    part (those without a session wait). For a heterogeneous tensor-parallel session also
    every member's compute per segment in that step (its group's rank order), else None."""
    mine: dict[str, float] | None = None
    ctx.group.barrier()
    start = time.perf_counter()
    if _refinable(session):
        rec = SpanRecorder(session.group.rank, enabled=True)
        rec.start_step(session.steps_done)
        with use_recorder(rec):
            session.step(micro)
        elapsed = time.perf_counter() - start
        record = rec.end_step()
        mine = segment_times(record) if record is not None else None
    else:
        if session is not None:
            session.step(micro)
        elapsed = time.perf_counter() - start
    got = ctx.group.gather_object((elapsed, mine))
    members = [m for _, m in got if m is not None]
    return max(t for t, _ in got), members or None


def _refinable(session: Session | None) -> TypeGuard[TPSession]:
    """Whether ``session`` runs a heterogeneous tensor-parallel plan over several devices."""
    return (
        isinstance(session, TPSession)
        and session.strategy is Strategy.XRONOS
        and session.group.size > 1
    )


def _plan_of(session: Session | None, ctx: WorkerContext) -> Plan | None:
    """The heterogeneous tensor-parallel plan ``session`` runs, on every rank of the world
    (collective); None for any other session."""
    mine = session.plan.to_dict() if _refinable(session) else None
    found = next((p for p in ctx.group.gather_object(mine) if p is not None), None)
    return Plan.from_dict(found) if found is not None else None


def _refinement(
    spec: SessionSpec,
    c: Candidate,
    measured: list[DeviceProfile],
    plan: Plan | None,
    seen: list[StepTimes],
) -> Refinement | None:
    """:func:`~xronos.run.refine.refine` for candidate ``c`` (None unless it ran a
    heterogeneous tensor-parallel ``plan`` whose timed steps were seen)."""
    if plan is None or not seen or c.strategy != "xronos":
        return None
    profiles = [measured[r] for r in sorted(c.devices)]
    chunks = (spec.shape.mlp_chunk, spec.shape.vocab_chunk)
    return refine(_key(c), spec.source.cfg, profiles, plan, seen, chunks)
