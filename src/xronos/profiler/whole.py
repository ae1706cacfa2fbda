"""A real training step of the whole model on this device: what the segments' sum stands for,
and what cutting its batch into micro-batches adds.

The segments (:mod:`xronos.profiler.measure`) are timed apart and their sum is scaled to a
whole step's time (:func:`xronos.profiler.run.scaled`). The same rounds also time the step
with its batch cut into micro-batches, paired with the whole one: the median difference is
what each micro-batch beyond the first costs the whole model, a signal of tens of ms on
``small``, where the segments' own cuts (one layer at a time, minima of two runs) can come
out at nothing when the host drifts between two timings.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from xronos.comm.mappings import TPGroup
from xronos.metrics.rss import PeakRSS, release, resident_bytes
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan
from xronos.profiler.measure import SegmentTimes, Shape, run_times
from xronos.train.optim import OptimConfig
from xronos.train.trainer import SLOW_FIRST_STEPS, Trainer

WHOLE_STEP_REPEATS = 3
"""Whole steps timed after the warm-up; the median of those that agree counts, as the
benchmark's measured step is the median of its counted steps. With one timed step, a step
that met a busy moment of the host set the scale of every cost of that device: three
profiles in a row predicted ``ci-2dev``'s fast device alone at 0.59-0.74 s and the slow one
at 1.59-2.50 s with one timed step, 0.70-0.74 s and 1.81-1.97 s with the median of three."""

WHOLE_STEP_AGREE = 0.10
"""How far (slowest / fastest - 1) the :data:`WHOLE_STEP_REPEATS` fastest timed steps may
lie apart and count. A quiet host times them within 3 % (the profiles above: 0.396-0.406 s);
a busy moment that spans two of three steps moves their median with it (measured once on
``ci-2dev`` at 1 Gbit/s: the fast device's step profiled at 0.560 s, measured 0.410 s in
the run, so the prediction of ``single`` was 37 % off)."""

WHOLE_STEP_MAX_REPEATS = 7
"""Most whole steps timed while the fastest ones disagree: a host busy for that long is the
host the run will meet. With the cut step of each round, seven rounds on ``small`` take
about 8 s on the fast device of ``ci-2dev`` (whose steps, the slow device stepping beside
it, never agreed within 10 % in three profiles) and up to 22 s on the slow one: most of a
profile's time (docs/benchmarks.md)."""


def agreeing(times: list[float], count: int = WHOLE_STEP_REPEATS) -> list[float] | None:
    """The ``count`` fastest of ``times`` when they lie within :data:`WHOLE_STEP_AGREE` of
    each other; None: too few, or they disagree (time another)."""
    fastest = sorted(times)[:count]
    if len(fastest) < count or fastest[-1] > fastest[0] * (1 + WHOLE_STEP_AGREE):
        return None
    return fastest


@dataclass(frozen=True)
class WholeStep:
    """What :func:`time_whole_step` measured."""

    seconds: float
    """The median whole step."""
    per_pass_s: float | None = None
    """What each micro-batch beyond the first adds to it (median of the paired differences,
    never negative); None: not timed cut (one pass asked, or one sequence)."""
    peak_bytes: int | None = None
    """The process's peak resident memory while the model was built and stepped, above
    what it held before (freed memory handed back first); None where the kernel's peak
    cannot be reset (:class:`~xronos.metrics.rss.PeakRSS`)."""


def time_whole_step(shape: Shape, passes: int = 1, repeats: int = WHOLE_STEP_REPEATS) -> WholeStep:
    """A real training step of the whole model on this device (random weights, LoRA when
    profiled with it): the median of the ``repeats`` fastest timed steps after
    :data:`~xronos.train.trainer.SLOW_FIRST_STEPS` untimed ones
    (the last one cut, when it is timed cut). It is the training loop's own step
    (:class:`~xronos.train.trainer.Trainer`, default optimizer settings): a bare
    forward + backward + AdamW ran 4-5 % faster than it on ``small``. While the fastest
    ``repeats`` timed steps disagree (:func:`agreeing`), it times another, up to
    :data:`WHOLE_STEP_MAX_REPEATS`, and then takes the median of them all. With ``passes`` > 1
    (at most the batch's sequences) each round also times the step with its batch cut into
    that many micro-batches, right after the whole one."""
    grown = _growth()
    trainer, ids = _trainer(shape)
    passes = min(passes, shape.batch_size)
    whole = [(ids, ids)]
    cut = [(part, part) for part in ids.tensor_split(passes)]

    def timed(micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        def step() -> None:
            trainer.step(micro)

        return run_times(step, 1)[0]

    for k in range(SLOW_FIRST_STEPS):
        trainer.step(cut if passes > 1 and k == SLOW_FIRST_STEPS - 1 else whole)
    wholes: list[float] = []
    extra: list[float] = []
    counted = None
    while counted is None and len(wholes) < max(repeats, WHOLE_STEP_MAX_REPEATS):
        wholes.append(timed(whole))
        if passes > 1:
            extra.append((timed(cut) - wholes[-1]) / (passes - 1))
        counted = agreeing(wholes, repeats)
    per_pass = max(statistics.median(extra), 0.0) if extra else None
    return WholeStep(statistics.median(counted or wholes), per_pass, grown())


def _growth() -> Callable[[], int | None]:
    """Start measuring: freed memory handed back, the kernel's peak reset at what the
    process holds now. The function returned gives the peak since, above that (None where
    the peak cannot be reset)."""
    release()
    before, peak = resident_bytes(), PeakRSS()
    return lambda: peak.peak_bytes() - before if peak.resettable else None


def _trainer(shape: Shape) -> tuple[Trainer, torch.Tensor]:
    """The whole model as ``single`` trains it, and a batch of ``shape`` for it."""
    cfg = shape.cfg
    plan = Plan.single(cfg)
    model = build_model(cfg, plan, TPGroup(), lora=shape.lora, recompute=shape.recompute)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)
    return Trainer(model, cfg, plan, TPGroup(), OptimConfig()), ids


STEP_PEAK_STEPS = 2
"""Untimed steps :func:`step_peak` takes. The first allocates AdamW's moments, but the
allocator's holdings grow over the next ones: ``small`` at 8 × 512 tokens peaked at 1,935,
2,002 and 2,009 MiB in its first three steps, and a one-step measurement predicted a run's
peak 17 % low."""


def step_peak(shape: Shape) -> int | None:
    """:data:`STEP_PEAK_STEPS` untimed training steps of the whole model: their peak
    resident memory above the process before the model, as :attr:`WholeStep.peak_bytes`;
    None where the kernel's peak cannot be reset."""
    grown = _growth()
    trainer, ids = _trainer(shape)
    for _ in range(STEP_PEAK_STEPS):
        trainer.step([(ids, ids)])
    return grown()


def split_to_whole(parts: SegmentTimes, per_pass_s: float, totals: dict[str, int]) -> SegmentTimes:
    """``parts`` with their per-micro-batch costs (``split_s``, ``embed_split_s``) replaced
    by ``per_pass_s``, the whole model's, shared out in proportion to the parts' times. Not
    as the parts' own cuts measured it: one layer's cut is a few ms against the noise of
    two timings, and on one device the layers' came out at 0 while the vocabulary's and the
    embedding's did not, which put a pipeline's whole cost of cutting on its last stage."""
    weights = {s: c(totals[s]) for s, c in parts.curves.items()}
    total = sum(weights.values()) + parts.embed_s
    if total <= 0:
        return parts
    return replace(
        parts,
        split_s={s: per_pass_s * w / total for s, w in weights.items()},
        embed_split_s=per_pass_s * parts.embed_s / total,
    )
