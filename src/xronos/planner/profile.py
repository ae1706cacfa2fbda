"""What the profiler measured on one device: linear cost curves per segment, memory, link.

``t(u) = a + b·u`` is the forward+backward time of ``u`` units of a segment at the real
batch and sequence shape. For ``attn`` and ``mlp`` it is the time of *all layers*
together (one layer's measurement times ``num_layers``), so that a plan's predicted step
time is the sum over segments. A device holding zero units of a segment spends nothing
on it: ``t(0) = 0``, not ``a``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from xronos.errors import UserError
from xronos.planner.comm import LinkModel, Network, Traffic


@dataclass(frozen=True)
class CostCurve:
    """``t(u) = a + b·u`` seconds for ``u > 0`` units, and 0 for ``u = 0``."""

    a: float
    b: float

    def __call__(self, units: int) -> float:
        return 0.0 if units <= 0 else self.a + self.b * units


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device's profile, as measured inside its own resource limits."""

    name: str
    """Device name from the cluster spec."""
    segments: dict[str, CostCurve]
    """``attn`` / ``mlp`` / ``vocab`` -> cost of that many units per training step."""
    replicated_s: float
    """Per-step time of the work every device repeats (embedding, norms, RoPE, optimizer)."""
    allreduce_s: float = 0.0
    """Time of one all-reduce of the activation size, measured on this device's link."""
    allreduces_per_step: int = 0
    """How many such all-reduces a training step performs."""
    memory_bytes: int = 0
    """Memory usable by the model on this device (0 = unknown/unbounded)."""
    unit_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of weights + gradients + optimizer state per unit of each segment."""
    base_bytes: int = 0
    """Bytes every device needs regardless of its units (replicated weights, activations)."""
    memory_scale: float = 1.0
    """The factor the activations' bytes in ``unit_bytes`` and ``base_bytes`` were scaled by
    so that the whole model's need is what a real step of it measured
    (:func:`xronos.profiler.bytes.memory_scale`); 1: as counted."""
    key: str = ""
    """Cache key: device spec + model shape + batch shape."""
    replicated_split: dict[str, float] = field(default_factory=dict)
    """Seconds of replicated work before each segment's barrier, when measured in real
    steps (calibration); empty = ``replicated_s`` split by the planner's default shares."""
    link: LinkModel | None = None
    """This device's link in the star model (:mod:`xronos.planner.comm`), fitted from
    point-to-point exchanges with every other device; None in profiles made before links
    were measured (then ``allreduce_s`` is all the planner knows)."""
    allreduce_fit: LinkModel | None = None
    """Line through the all-reduce times measured over ``allreduce_group`` at two sizes
    (the whole operation, not one round)."""
    allreduce_group: tuple[str, ...] = ()
    """The devices ``allreduce_fit`` was measured on."""
    traffic: Traffic = field(default_factory=dict)
    """A tensor-parallel step's collectives per barrier at the profiled batch shape
    (:func:`xronos.planner.comm.tp_traffic`); empty in old profiles."""
    split_s: dict[str, float] = field(default_factory=dict)
    """Per segment (all units, all layers): seconds each micro-batch beyond the first adds
    when the batch is cut into several (weights re-read, gradients written per pass);
    empty: cutting is free (costs scale with tokens)."""
    tied_grad_bytes: int = 0
    """Bytes of the tied embedding's gradient when it trains (full fine-tuning of a tied
    model; 0 otherwise). Nonzero: a pipeline's end stages exchange the matrix's rows of
    each step's tokens (:mod:`xronos.pipeline.tied`)."""
    step_scale: float = 1.0
    """The factor the measured segments were scaled by so that they add up to a whole real
    step on this device (:func:`xronos.profiler.run.scaled`); 1: as measured."""
    sync_s: float = 0.0
    """Measured wait per barrier among the profiled devices when each reaches it at the
    same time on average: how far the slowest of them strays from its mean (a throttled
    CPU runs in bursts; a busy host preempts). 0: not measured, or one device."""
    overlap_loss: float = 0.0
    """Of the time an all-reduce is overlapped with computing, the share the overlap fails
    to hide, measured on the profiled group (:mod:`xronos.profiler.overlap`): the same on
    every device of it. 0: not measured (hidden as if free), or one device."""
    embed_s: float = 0.0
    """A tied model's whole token embedding on this device, forward + backward (+ update)
    for the profiled batch: what a pipeline's first stage runs besides its layers (tensor
    parallelism splits it with the vocabulary; an untied embedding is in ``replicated_s``).
    0: not measured."""
    embed_split_s: float = 0.0
    """Of ``embed_s``, what each micro-batch beyond the first adds (its dense gradient is
    written once per pass); see ``split_s``."""
    update_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the step-end update (gradient norms + AdamW) of one decoder layer
    (``layer``), the embedding (``embed``) and the final norm + LM head (``head``), as
    trained (:mod:`xronos.profiler.update`). The segments' times include it; a pipeline,
    which updates once after its schedule, takes it out. Empty: not measured."""

    def replicated_before(self, segment: str, share: Mapping[str, float]) -> float:
        """Replicated work this device does before ``segment``'s barrier."""
        if self.replicated_split:
            return self.replicated_split.get(segment, 0.0)
        return self.replicated_s * share[segment]

    def step_time(self, units: dict[str, int]) -> float:
        """Predicted step time of this device alone holding ``units``."""
        return self.replicated_s + sum(self.segments[s](u) for s, u in units.items())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("link", "allreduce_fit"):
            v = getattr(self, k)
            d[k] = None if v is None else v.to_dict()
        d["allreduce_group"] = list(self.allreduce_group)
        d["traffic"] = {s: [list(x) for x in v] for s, v in self.traffic.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        try:
            return cls(
                name=d["name"],
                segments={k: CostCurve(**v) for k, v in d["segments"].items()},
                replicated_s=float(d["replicated_s"]),
                allreduce_s=float(d.get("allreduce_s", 0.0)),
                allreduces_per_step=int(d.get("allreduces_per_step", 0)),
                memory_bytes=int(d.get("memory_bytes", 0)),
                unit_bytes={k: int(v) for k, v in d.get("unit_bytes", {}).items()},
                base_bytes=int(d.get("base_bytes", 0)),
                memory_scale=float(d.get("memory_scale", 1.0)),
                key=str(d.get("key", "")),
                replicated_split={k: float(v) for k, v in d.get("replicated_split", {}).items()},
                link=_link(d.get("link")),
                allreduce_fit=_link(d.get("allreduce_fit")),
                allreduce_group=tuple(str(n) for n in d.get("allreduce_group", ())),
                traffic={
                    s: [(int(c), int(b)) for c, b in v] for s, v in d.get("traffic", {}).items()
                },
                split_s={k: float(v) for k, v in d.get("split_s", {}).items()},
                tied_grad_bytes=int(d.get("tied_grad_bytes", 0)),
                step_scale=float(d.get("step_scale", 1.0)),
                sync_s=float(d.get("sync_s", 0.0)),
                overlap_loss=float(d.get("overlap_loss", 0.0)),
                embed_s=float(d.get("embed_s", 0.0)),
                embed_split_s=float(d.get("embed_split_s", 0.0)),
                update_s={k: float(v) for k, v in d.get("update_s", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"profile: malformed device entry ({e}); re-run `xronos profile`"
            ) from e


def _link(d: Mapping[str, Any] | None) -> LinkModel | None:
    return None if d is None else LinkModel.from_dict(d)


def network_of(profiles: Sequence[DeviceProfile]) -> Network | None:
    """The star network of ``profiles``; None unless every one of them has its link."""
    links = [p.link for p in profiles]
    if not profiles or any(x is None for x in links):
        return None
    measured: tuple[tuple[str, ...], LinkModel] | None = None
    fits = {(p.allreduce_group, p.allreduce_fit) for p in profiles}
    if len(fits) == 1:
        group, fit = next(iter(fits))
        measured = None if fit is None else (group, fit)
    names = tuple(p.name for p in profiles)
    loss = max(p.overlap_loss for p in profiles)
    return Network(names, tuple(x for x in links if x is not None), measured, loss)


def save_profiles(path: str, profiles: list[DeviceProfile], meta: dict[str, Any]) -> None:
    from xronos.utils import atomic_write_text

    atomic_write_text(
        path, json.dumps({**meta, "devices": [p.to_dict() for p in profiles]}, indent=2)
    )


def load_profiles(path: str) -> tuple[list[DeviceProfile], dict[str, Any]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise UserError(f"{path}: profile not found; create it with `xronos profile`") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    devices = [DeviceProfile.from_dict(d) for d in data.pop("devices", [])]
    if not devices:
        raise UserError(f"{path}: no devices in profile; re-run `xronos profile`")
    return devices, data


def slowed(p: DeviceProfile, factor: float) -> DeviceProfile:
    """``p`` on a device whose computing takes ``factor`` times as long as when it was
    profiled (another program took part of its CPU, or left it): every compute time
    scaled, its links, memory and the barrier's measured wait as they were."""

    def times(d: Mapping[str, float]) -> dict[str, float]:
        return {k: v * factor for k, v in d.items()}

    return replace(
        p,
        segments={k: CostCurve(c.a * factor, c.b * factor) for k, c in p.segments.items()},
        replicated_s=p.replicated_s * factor,
        replicated_split=times(p.replicated_split),
        split_s=times(p.split_s),
        embed_s=p.embed_s * factor,
        embed_split_s=p.embed_split_s * factor,
        update_s=times(p.update_s),
    )


def on_the_wire(profiles: Sequence[DeviceProfile], element_size: int) -> list[DeviceProfile]:
    """``profiles`` with the activation all-reduces of their traffic sent in elements of
    ``element_size`` bytes (2: ``--comm-dtype bf16``) instead of fp32's 4; other
    collectives (the loss's statistics, the gradient norm) keep their size."""
    if element_size == 4:
        return list(profiles)
    out = []
    for p in profiles:
        act = max((b for entries in p.traffic.values() for _, b in entries), default=0)
        traffic = {
            s: [(c, b * element_size // 4 if b == act else b) for c, b in entries]
            for s, entries in p.traffic.items()
        }
        out.append(replace(p, traffic=traffic))
    return out
