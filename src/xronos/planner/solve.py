"""The Xronos planner: profiles in, a heterogeneous tensor-parallel Plan out.

A training step is a sequence of barriers (all-reduces), and every barrier closes one
segment: attention, MLP or vocabulary. Device ``i`` reaches the barrier of segment ``s``
after its replicated work ``r_{i,s}`` and its shard ``t_{i,s}(u)``; the barrier releases
when the last device arrives, so the predicted step time is::

    Σ_s max_i (r_{i,s} + t_{i,s}(u_{i,s}))  +  transfer

and each segment is balanced on its own, exactly (:mod:`xronos.planner.balance`).

**Replicated work** (norms, RoPE, embedding, optimizer) is included. It does not depend
on the units, but it does shift *when* a device can start its shard: a device that is
2.5× slower also spends 2.5× longer on its norms, so it must take fewer units to arrive
with the others. The profile measures one total ``replicated_s``; ``replicated_share``
says which barrier each part precedes. The default puts half before the attention
barrier (input norm, RoPE, embedding, optimizer) and half before the MLP barrier
(post-attention norm) — each layer has one norm before each — and none before the
vocabulary barrier (one final norm per step, negligible). The shares sum to 1, so a
device's predicted times over the segments add up to ``DeviceProfile.step_time``.

**Memory** couples the segments: every device must hold its units of all three within
its budget; how the planner places them is described in :mod:`xronos.planner.memory`
(exact whenever the segments' own optima fit in memory together).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner.balance import check_curve
from xronos.planner.memory import Placement, own_caps, place, unit_bytes
from xronos.planner.plan import (
    SEGMENTS,
    Plan,
    default_mlp_chunk,
    default_vocab_chunk,
    segment_units,
)
from xronos.planner.profile import DeviceProfile, network_of

#: Fraction of a device's ``replicated_s`` done before each segment's barrier.
DEFAULT_REPLICATED_SHARE: dict[str, float] = {"attn": 0.5, "mlp": 0.5, "vocab": 0.0}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _shares(replicated_share: Mapping[str, float] | None) -> dict[str, float]:
    share = dict(DEFAULT_REPLICATED_SHARE if replicated_share is None else replicated_share)
    unknown = set(share) - set(SEGMENTS)
    if unknown or any(v < 0 for v in share.values()) or abs(sum(share.values()) - 1) > 1e-9:
        raise ValueError(f"replicated_share must map {SEGMENTS} to fractions summing to 1: {share}")
    return {s: share.get(s, 0.0) for s in SEGMENTS}


def _check_profiles(profiles: Sequence[DeviceProfile]) -> None:
    if not profiles:
        raise UserError("planner: no device profiles; run `xronos profile` on the cluster first")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise UserError(f"planner: device names repeat in {names}; give every device its own name")
    for p in profiles:
        for s in SEGMENTS:
            if s not in p.segments:
                raise UserError(
                    f"profile of device '{p.name}' has no {s!r} cost curve; re-run `xronos profile`"
                )
            if (why := check_curve(p.segments[s])) is not None:
                raise UserError(
                    f"profile of device '{p.name}' has a {why} for {s}; re-run `xronos profile`"
                )
        split = ((f"replicated_split[{k!r}]", v) for k, v in p.replicated_split.items())
        for what, v in (("replicated_s", p.replicated_s), *split):
            if not math.isfinite(v) or v < 0:
                raise UserError(
                    f"profile of device '{p.name}' has {what}={v}; re-run `xronos profile`"
                )


def _budget(p: DeviceProfile) -> int | None:
    """Bytes left for units on ``p`` (None = unbounded); UserError if not even the base fits."""
    if p.memory_bytes <= 0:
        return None
    if p.base_bytes > p.memory_bytes:
        raise UserError(
            f"device '{p.name}' has {_mib(p.memory_bytes)} but needs {_mib(p.base_bytes)} before "
            "holding any shard (replicated weights, activations); give it more memory or drop it "
            "from the cluster"
        )
    return p.memory_bytes - p.base_bytes


def _check_coverable(
    seg: str,
    total: int,
    caps: Sequence[int | None],
    low: int,
    profiles: Sequence[DeviceProfile],
    budgets: Sequence[int | None],
) -> None:
    """UserError naming why ``seg`` cannot be placed at all (even with nothing else)."""
    n = len(profiles)
    if low * n > total:
        raise UserError(
            f"min_units asks every device for {low} {seg} units but the model has only {total} "
            f"for {n} devices; lower min_units"
        )
    for p, cap, b in zip(profiles, caps, budgets, strict=True):
        if cap is not None and cap < low:
            raise UserError(
                f"device '{p.name}' has {_mib(b or 0)} usable but min_units asks it for {low} "
                f"{seg} units of {_mib(unit_bytes(p, seg))} each; lower min_units or give it "
                "more memory"
            )
    if any(c is None for c in caps) or sum(c for c in caps if c is not None) >= total:
        return
    for p, cap, b in zip(profiles, caps, budgets, strict=True):
        if cap == 0:
            raise UserError(
                f"device '{p.name}' has {_mib(b or 0)} usable but one {seg} unit needs "
                f"{_mib(unit_bytes(p, seg))}; give it more memory or drop it from the cluster"
            )
    held = sum(c for c in caps if c is not None)
    raise UserError(
        f"the cluster's memory holds only {held} of the model's {total} {seg} units; "
        "add memory or devices, or use a smaller model"
    )


def _check_total_memory(
    profiles: Sequence[DeviceProfile], budgets: Sequence[int | None], totals: Mapping[str, int]
) -> None:
    if any(b is None for b in budgets):
        return
    need = sum(totals[s] * min(unit_bytes(p, s) for p in profiles) for s in SEGMENTS)
    have = sum(b for b in budgets if b is not None)
    if need > have:
        raise UserError(
            f"the cluster has {_mib(have)} usable but the model's sharded weights, gradients and "
            f"optimizer state need {_mib(need)}; add devices or memory, or use a smaller model"
        )


def plan_tp(
    cfg: ModelConfig,
    profiles: list[DeviceProfile],
    *,
    mlp_chunk: int | None = None,
    vocab_chunk: int | None = None,
    min_units: dict[str, int] | None = None,
    replicated_share: Mapping[str, float] | None = None,
) -> Plan:
    """The heterogeneity-aware plan (strategy ``xronos``); see the module docstring.

    Args:
        cfg: the model; it fixes the units of every segment.
        profiles: one per device, in rank order. Their cost curves must be per unit of
            the same ``mlp_chunk`` / ``vocab_chunk`` as asked for here.
        mlp_chunk, vocab_chunk: unit sizes (default: ``default_mlp_chunk`` /
            ``default_vocab_chunk`` of the model).
        min_units: per segment, the fewest units every device must hold (default 0: a
            device may hold none of a segment, e.g. with more devices than KV groups).
        replicated_share: fraction of each device's replicated work before each
            segment's barrier (default ``DEFAULT_REPLICATED_SHARE``).

    Returns:
        A Plan whose ``predicted_s[s][i]`` is when device ``i`` reaches the barrier of
        ``s`` (its replicated share plus its shard), in seconds per step.

    Raises:
        UserError: a profile is unusable, or memory or ``min_units`` admit no plan.
    """
    _check_profiles(profiles)
    mlp_chunk = mlp_chunk or default_mlp_chunk(cfg.intermediate_size)
    vocab_chunk = vocab_chunk or default_vocab_chunk(cfg.vocab_size)
    if mlp_chunk < 1 or vocab_chunk < 1:
        raise UserError(f"mlp_chunk={mlp_chunk}, vocab_chunk={vocab_chunk}: chunks must be >= 1")
    totals = segment_units(cfg, mlp_chunk, vocab_chunk)
    low = {s: int((min_units or {}).get(s, 0)) for s in SEGMENTS}
    if unknown := set(min_units or {}) - set(SEGMENTS):
        raise UserError(
            f"min_units: unknown segment(s) {sorted(unknown)}; use {', '.join(SEGMENTS)}"
        )
    if any(v < 0 for v in low.values()):
        raise UserError(f"min_units must be non-negative, got {min_units}")
    budgets = [_budget(p) for p in profiles]
    _check_total_memory(profiles, budgets, totals)
    own = own_caps(profiles, budgets)
    for s in SEGMENTS:
        _check_coverable(s, totals[s], own[s], low[s], profiles, budgets)

    best = place(Placement(profiles, totals, _shares(replicated_share), low), budgets)
    if best is None:
        need = sum(totals[s] * max(unit_bytes(p, s) for p in profiles) for s in SEGMENTS)
        raise UserError(
            f"found no way to place the model's shards ({_mib(need)}) within the devices' "
            "memory; add memory or devices, or use a smaller model"
        )
    return Plan(
        strategy="xronos",
        devices=tuple(p.name for p in profiles),
        mlp_chunk=mlp_chunk,
        vocab_chunk=vocab_chunk,
        predicted_s={s: best[s].finish_s for s in SEGMENTS},
        **{s: best[s].units for s in SEGMENTS},
    )


# -- even plans, predictions, the ideal ------------------------------------------------------
def plan_even(
    cfg: ModelConfig,
    devices: Sequence[str] | Sequence[DeviceProfile],
    *,
    replicated_share: Mapping[str, float] | None = None,
) -> Plan:
    """Megatron's even split (``Plan.even``: the remainder goes to the first devices).

    Given profiles instead of names, the plan also carries their predicted times.
    """
    names = [d if isinstance(d, str) else d.name for d in devices]
    plan = Plan.even(cfg, names)
    profiles = [d for d in devices if isinstance(d, DeviceProfile)]
    return annotate(plan, profiles, replicated_share=replicated_share) if profiles else plan


def _segment_times(
    plan: Plan, profiles: Sequence[DeviceProfile], share: Mapping[str, float]
) -> dict[str, tuple[float, ...]]:
    if [p.name for p in profiles] != list(plan.devices):
        raise UserError(
            f"plan devices {list(plan.devices)} do not match the profiled devices "
            f"{[p.name for p in profiles]}; re-run `xronos plan` for this cluster"
        )
    _check_profiles(profiles)
    return {
        s: tuple(
            p.replicated_before(s, share) + p.segments[s](u)
            for p, u in zip(profiles, plan.split(s), strict=True)
        )
        for s in SEGMENTS
    }


def annotate(
    plan: Plan,
    profiles: Sequence[DeviceProfile],
    *,
    replicated_share: Mapping[str, float] | None = None,
) -> Plan:
    """``plan`` with ``predicted_s`` filled from ``profiles`` (e.g. for an even plan)."""
    times = _segment_times(plan, profiles, _shares(replicated_share))
    return Plan.from_dict({**plan.to_dict(), "predicted_s": times})


def transfer_by_segment(profiles: Sequence[DeviceProfile]) -> dict[str, float]:
    """Per-step seconds of collectives at each barrier (``attn``, ``mlp``, ``vocab``) and
    once per step (``step``: gradient norm, ...), over all of ``profiles``' devices.

    With every device's link and the step's traffic profiled, this is the star model of
    :mod:`xronos.planner.comm` (one device: nothing). Profiles from before links were
    measured give the old single figure: all-reduces per step × the slowest device's
    all-reduce time, all under ``step``.
    """
    net = network_of(profiles)
    traffic = profiles[0].traffic if profiles else {}
    if net is None or not traffic:
        legacy = max((p.allreduce_s * p.allreduces_per_step for p in profiles), default=0.0)
        return {"step": legacy if len(profiles) > 1 else 0.0}
    return net.traffic_s(traffic, [p.name for p in profiles])


def _hidden_by_segment(
    times: Mapping[str, Sequence[float]], profiles: Sequence[DeviceProfile]
) -> dict[str, float]:
    """Per segment, the collectives' seconds its weight gradients hide
    (:meth:`~xronos.planner.comm.Network.hidden_s`)."""
    net = network_of(profiles)
    if net is None or len(profiles) < 2 or not profiles[0].traffic:
        return {}
    barriers = {s: max(t) for s, t in times.items()}
    return net.hidden_s(profiles[0].traffic, [p.name for p in profiles], barriers)


def sync_by_segment(
    times: Mapping[str, Sequence[float]], profiles: Sequence[DeviceProfile]
) -> dict[str, float]:
    """Per segment, the expected extra wait at its barriers from devices that do not arrive
    on time (:attr:`~xronos.planner.profile.DeviceProfile.sync_s`, measured when every device
    brings the same mean work): a barrier whose last device is later than the next by a gap
    ``g`` waits ``max(0, sync − g/2)`` more — a device that is always last by far waits for
    no one's bursts but its own, whose mean its compute already counts. The step's own
    collectives (gradient norm, ...) wait ``sync`` each."""
    if len(profiles) < 2:
        return {}
    sync = max(p.sync_s for p in profiles)
    traffic = profiles[0].traffic
    if sync <= 0 or not traffic:
        return {}
    out: dict[str, float] = {}
    for s, entries in traffic.items():
        count = sum(c for c, _ in entries)
        if count <= 0:
            continue
        t = sorted(times.get(s, ()), reverse=True)
        gap = (t[0] - t[1]) / count if len(t) > 1 else 0.0
        out[s] = count * max(0.0, sync - gap / 2)
    return out


def transfer_time(profiles: Sequence[DeviceProfile]) -> float:
    """Per-step collective time of tensor parallelism over these devices (Σ of
    :func:`transfer_by_segment`)."""
    return sum(transfer_by_segment(profiles).values())


def predict(
    plan: Plan,
    profiles: Sequence[DeviceProfile],
    *,
    replicated_share: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """What ``plan`` should do on devices with these ``profiles``, per step.

    Returns a JSON-able dict: ``segments[s]`` with each device's arrival time
    (``finish_s``), the barrier time (``barrier_s``), each device's wait (``idle_s``) and
    the collectives' time after the barrier (``transfer_s``); per device ``compute_s``
    (replicated work + shards, = ``DeviceProfile.step_time``), ``idle_s`` and
    ``idle_ratio`` (idle / step time, docs/architecture.md, Measurement); ``compute_step_s``
    (Σ barriers);
    ``transfer_s`` (every collective of the step, :func:`transfer_by_segment`, less
    what the weight gradients hide behind the column seams' backward all-reduces);
    ``step_time_s`` (Σ barriers + transfer); ``idle_ratio_mean`` and ``idle_ratio_max``.
    """
    times = _segment_times(plan, profiles, _shares(replicated_share))
    by_segment = transfer_by_segment(profiles)
    hidden = _hidden_by_segment(times, profiles)
    by_segment = {s: t - hidden.get(s, 0.0) for s, t in by_segment.items()}
    jitter = sync_by_segment(times, profiles)
    segments: dict[str, Any] = {}
    for s, t in times.items():
        barrier = max(t)
        segments[s] = {
            "finish_s": list(t),
            "barrier_s": barrier,
            "idle_s": [barrier - x for x in t],
            "transfer_s": by_segment.get(s, 0.0),
            "sync_s": jitter.get(s, 0.0),
        }
    n = plan.world_size
    transfer = sum(by_segment.values())
    sync = sum(jitter.values())
    compute = sum(seg["barrier_s"] for seg in segments.values())
    step = compute + transfer + sync
    idle = [sum(seg["idle_s"][i] for seg in segments.values()) for i in range(n)]
    ratio = [x / step if step > 0 else 0.0 for x in idle]
    return {
        "devices": list(plan.devices),
        "segments": segments,
        "compute_s": [sum(t[i] for t in times.values()) for i in range(n)],
        "idle_s": idle,
        "idle_ratio": ratio,
        "idle_ratio_mean": sum(ratio) / n,
        "idle_ratio_max": max(ratio),
        "compute_step_s": compute,
        "transfer_s": transfer,
        "sync_s": sync,
        "step_time_s": step,
    }


def ideal_step_time(
    profiles: Sequence[DeviceProfile],
    cfg: ModelConfig,
    *,
    mlp_chunk: int | None = None,
    vocab_chunk: int | None = None,
    transfer_s: float = 0.0,
) -> float:
    """The limit of any split: the compute bound of docs/architecture.md (Measurement)
    plus the transfer, ``1 / Σ_i (1 / T_i^solo) + transfer_s``.

    ``T_i^solo`` is device ``i``'s predicted time to run the whole step alone (every unit
    of every segment plus its replicated work), ignoring its memory limit.
    """
    _check_profiles(profiles)
    totals = segment_units(
        cfg,
        mlp_chunk or default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk or default_vocab_chunk(cfg.vocab_size),
    )
    solo = [p.step_time(totals) for p in profiles]
    if min(solo) <= 0:  # a device that does the step in no time makes the limit zero
        return transfer_s
    return 1.0 / sum(1.0 / t for t in solo) + transfer_s
