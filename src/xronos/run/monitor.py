"""What a fine-tuning run shows and leaves behind: progress, metrics.jsonl, the summary.

``RunMonitor.on_event`` receives rank 0's events (plan, step, eval, checkpoint); the
launcher reports a lost device, a returning one and the resumption (:meth:`RunMonitor.lost`,
:meth:`RunMonitor.joined`, :meth:`RunMonitor.resuming`: ``{"event": ...}`` lines in
``metrics.jsonl``); at the end
``finish`` writes ``summary.md``, ``loss.png``, ``timeline.png`` and ``trace.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xronos.metrics import (
    MetricsWriter,
    analyze_pipeline_step,
    analyze_step,
    is_pipeline,
    write_trace,
)
from xronos.metrics.records import StepRecord
from xronos.planner.plan import Plan
from xronos.run.autotable import auto_table
from xronos.run.eventtext import event_text
from xronos.utils import atomic_write_text

TRACE_STEPS = 3  # the last steps kept for trace.json and the timeline


class RunMonitor:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        score: Callable[[list[list[int]]], float | None],
        tensorboard: bool = False,
        out: Any = None,
    ) -> None:
        self.run_dir, self.total, self.score = run_dir, total_steps, score
        self.out = out or sys.stdout
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self.losses: list[tuple[int, float]] = []
        self.evals: list[dict[str, Any]] = []
        self.idle: list[list[float]] = []
        self.tokens = 0
        self.train_s = 0.0
        self.last_t: float | None = None
        self.records: list[list[StepRecord]] = []
        self.plan: Plan | None = None
        self.profiles: list[dict[str, Any]] = []
        """The devices' calibrated profiles, when this run planned from profiles."""
        self.measured: list[dict[str, Any]] = []
        """The devices' profiles as measured (before calibration) at the latest start."""
        self.first_measured: list[dict[str, Any]] = []  # the first start's: the cache keeps it
        self.plan_s: float | None = None
        self.devices: list[str] = []
        self.checkpoint: str | None = None
        self.every = max(1, total_steps // 20)
        self.last_step = 0
        """The last step reported done."""
        self.events: list[dict[str, Any]] = []
        """``device_lost``, ``device_joined``, ``resumed`` and ``replan`` events, as in
        ``metrics.jsonl``."""
        self.step_hooks: list[Callable[[int], None]] = []
        """Called with each step number as it arrives (e.g. emulation that starts at a step)."""
        self._resume: dict[str, int] | None = None
        self.tb = _tensorboard(run_dir) if tensorboard else None
        self.started = time.perf_counter()
        self.bar: Any = None
        if getattr(self.out, "isatty", lambda: False)():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.bar.add_task("train", total=total_steps, status="starting")

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            print(line, file=self.out, flush=True)

    def event(self, name: str, step: int, **fields: Any) -> None:
        """One ``{"event": name, "step": step, ...}`` line in ``metrics.jsonl``."""
        row = {"event": name, "step": step, **fields}
        self.events.append(row)
        self.metrics.write(row)

    def lost(self, device: str, rank: int, reason: str) -> int:
        """A device was lost after :attr:`last_step`: log it; returns that step."""
        step = self.last_step
        self.event("device_lost", step, device=device, rank=rank, reason=reason)
        self.say(f"device lost after step {step}: {device!r} (rank {rank}) {reason}")
        return step

    def resuming(self, step: int, lost_step: int) -> None:
        """The survivors start again from ``step`` (a checkpoint's, or 0): the next plan is
        logged as ``resumed``, and the progress and summary continue from ``step``."""
        self._resume = {"step": step, "recomputed_steps": max(0, lost_step - step)}
        self.losses = [(k, x) for k, x in self.losses if k <= step]
        self.last_step, self.last_t = step, None  # the restart is not a step's time
        self.idle, self.records, self.devices = [], [], []  # per device of the new plan

    def joined(self, devices: list[str], step: int) -> None:
        """Lost devices come back after ``step`` (their checkpoint): log each one; the next
        plan is logged as ``resumed``."""
        for name in devices:
            self.event("device_joined", step, device=name)
        self.say(
            f"device{'s' if len(devices) > 1 else ''} back after step {step}: "
            f"{', '.join(repr(d) for d in devices)}; profiling and planning again"
        )
        self.resuming(step, self.last_step)

    def _resumed(self, strategy: str, devices: list[str]) -> None:
        if self._resume is None:
            return
        step, redo, self._resume = self._resume["step"], self._resume["recomputed_steps"], None
        self.event("resumed", step, devices=devices, strategy=strategy, recomputed_steps=redo)
        self.say(
            f"resumed from step {step} on {', '.join(devices)} ({strategy}); "
            f"{redo} step{'s' if redo != 1 else ''} to do again"
        )

    def on_event(self, rank: int, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        if kind in ("plan", "pipeline"):
            self.measured = ev.get("measured", [])
            self.first_measured = self.first_measured or self.measured
        if kind == "plan":
            self.plan, self.plan_s = Plan.from_dict(ev["plan"]), ev["seconds"]
            self.profiles = ev.get("profiles", [])
            if ev.get("given"):
                how = f"{self.plan.strategy}, given"
            else:
                src = "cached profile" if ev.get("cached") else "profiled"
                how = f"{src} + calibrated in {ev['seconds']:.1f} s"
            self.say(f"plan ({how}):\n{self.plan.table()}")
            atomic_write_text(self.run_dir / "plan.json", self.plan.to_json())
            self._resumed(self.plan.strategy, list(self.plan.devices))
        elif kind == "pipeline":
            from xronos.planner.hybrid import HybridPlan
            from xronos.planner.pipeline import PipelinePlan

            if "groups" in ev["plan"]:  # a hybrid: stages, one of them tensor-parallel
                hybrid = HybridPlan.from_dict(ev["plan"])
                self.say(f"hybrid stages:\n{hybrid.table()}")
                atomic_write_text(self.run_dir / "plan.json", json.dumps(ev["plan"], indent=2))
                self._resumed(ev["strategy"], list(hybrid.devices))
                return
            pplan = PipelinePlan.from_dict(ev["plan"])
            self.say(f"pipeline stages:\n{pplan.table()}")
            atomic_write_text(self.run_dir / "plan.json", pplan.to_json())
            self._resumed(ev["strategy"], list(pplan.devices))
        elif kind == "auto":
            trials, refined = ev.get("trials", {}), ev.get("refined")
            self.say(auto_table(ev["choice"], ev["ran"], trials, refined, ev.get("against_alone")))
            atomic_write_text(self.run_dir / "auto.json", json.dumps(ev, indent=2))
        elif kind == "step":
            self._step(ev)
        elif kind == "eval":
            self._eval(ev)
        elif kind == "checkpoint":
            self.checkpoint = ev["path"]
        elif kind == "rebalance":
            self._rebalanced(ev)
        elif kind == "rebalance_held":
            self.event("replan_held", ev["step"], reason=ev["reason"])
            self.say(f"step {ev['step']}: a better plan was found, but {ev['reason']}; kept")
        elif kind in ("restage", "restage_kept"):  # a pipeline's restart offer (run.restage)
            keys = ["why", "relative", "now_s", "best", "best_s", "saving_s", "restart_s", "left"]
            keys += ["held"] if kind == "restage_kept" else []
            self.event(kind, ev["step"], **{k: ev[k] for k in keys})
            self.say(f"step {ev['step']}: {event_text({'event': kind, **ev})}")
        elif kind == "io_restored":
            self.event("io_threads_restored", ev["step"], device=ev["device"])
            self.say(
                f"step {ev['step']}: another program is using {ev['device']!r}'s CPU; its "
                "collectives' I/O threads are back in the normal scheduling class"
            )
        elif kind == "spacing":
            self.say(
                f"checkpoint every {ev['every']} steps ({ev['step_s']:.2f} s each): a lost "
                "device costs at most about a minute of training"
            )

    def _rebalanced(self, ev: dict[str, Any]) -> None:
        before, self.plan = Plan.from_dict(ev["before"]), Plan.from_dict(ev["plan"])
        pairs = zip(self.plan.devices, ev["relative"], strict=False)
        speeds = ", ".join(f"{d} ×{r:.2f}" for d, r in pairs)
        kind, gain = "replan", (ev["now_s"] - ev["then_s"]) * ev["steps_left"]
        extra: dict[str, Any] = {}
        if ev.get("why") == "release":
            kind, gone = "release", [d for d in before.devices if d not in self.plan.devices]
            extra = {"released": gone, "measured_s": ev["now_s"], "predicted_s": ev["then_s"]}
            reason = headline = (
                f"{', '.join(gone)} no longer paid for {'its' if len(gone) == 1 else 'their'} "
                f"part: {ev['now_s']:.3f} s a step measured, {ev['then_s']:.3f} predicted on "
                f"{', '.join(self.plan.devices)}; released"
            )
        elif ev.get("why") == "undo":
            kind = "replan_undone"
            reason = headline = (
                f"the steps after the last move were slower ({ev['now_s']:.3f} s a step against "
                f"{ev['then_s']:.3f} before it); moved back"
            )
        elif ev.get("why") == "balance":
            reason = f"the first steps were out of balance: compute against the busiest {speeds}"
            headline = (
                f"the first steps were out of balance (compute against the busiest: {speeds})"
            )
        else:
            reason = f"compute relative to the other devices changed: {speeds}"
            headline = f"device speeds changed (compute relative to the others: {speeds})"
        self.event(
            kind,
            ev["step"],
            reason=reason,
            relative=ev["relative"],
            before=ev["before"],
            after=ev["plan"],
            predicted_gain_s=gain,
            move_s=ev["seconds"],
            **extra,
        )
        self.say(
            f"step {ev['step']}: {headline}; moved to a new plan in {ev['seconds']:.1f} s, "
            f"{'measured' if kind != 'replan' else 'predicted'} {ev['now_s']:.3f} → "
            f"{ev['then_s']:.3f} s/step:\n{self.plan.table()}"
        )
        atomic_write_text(self.run_dir / "plan.json", self.plan.to_json())

    def _step(self, ev: dict[str, Any]) -> None:
        now = time.perf_counter()
        dt = now - self.last_t if self.last_t is not None else None
        self.last_t = now
        records = [StepRecord.from_dict(r) for r in ev.get("records", [])]
        idle: list[float] = []
        if len(records) > 1:
            sm = analyze_pipeline_step(records) if is_pipeline(records) else analyze_step(records)
            idle = [d.idle_ratio for d in sm.devices]
            self.devices = [d.name for d in sm.devices]
            self.records = [*self.records[-(TRACE_STEPS - 1) :], records]
            self.idle.append(idle)
        if dt is not None:
            self.tokens += ev["tokens"]
            self.train_s += dt
        tps = self.tokens / self.train_s if self.train_s > 0 else None  # none timed yet
        step, loss = ev["step"], ev["loss"]
        self.losses.append((step, loss))
        self.last_step = step
        for hook in self.step_hooks:
            hook(step)
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": ev["grad_norm"],
            "lr": ev["lr"],
            "step_time_s": dt,
            "tokens_per_s": tps,
            "idle_ratio": idle,
        }
        self.metrics.write(row)
        if self.tb is not None:
            self.tb.add_scalar("train/loss", loss, step)
        idle_txt = " ".join(f"{x:.0%}" for x in idle) if idle else "-"
        tps_txt = f"{tps:,.0f}" if tps is not None else "-"
        status = f"loss {loss:.4f}  {tps_txt} tok/s  idle {idle_txt}"
        if self.bar is not None:
            if not self.bar.live.is_started:
                self.bar.start()
            self.bar.update(self.task, completed=step, status=status)
        elif step % self.every == 0 or step == self.total:
            self.say(f"step {step:>5}/{self.total}  {status}")

    def _eval(self, ev: dict[str, Any]) -> None:
        acc = self.score(ev["generated"])
        entry = {
            "step": ev["step"],
            "when": ev["when"],
            "eval_loss": ev["eval_loss"],
            "accuracy": acc,
            "seconds": ev["seconds"],
        }
        self.evals.append(entry)
        self.metrics.write({"eval": entry})
        acc_txt = f"{acc:.1%}" if acc is not None else "-"
        self.say(
            f"eval ({ev['when']}, step {ev['step']}): loss {ev['eval_loss']:.4f}  "
            f"held-out exact match {acc_txt}"
        )

    def finish(self, step: int) -> str:
        """Close the logs and write the plots and ``summary.md`` (``step``: steps done)."""
        if self.bar is not None:
            self.bar.stop()
        self.metrics.close()
        wall = time.perf_counter() - self.started
        self._plots()
        summary = self._summary(step, wall)
        atomic_write_text(self.run_dir / "summary.md", summary)
        if self.tb is not None:
            self.tb.close()
        return summary

    def _plots(self) -> None:
        from xronos.metrics import plot_losses, plot_timeline

        if self.losses:
            plot_losses(self.run_dir / "loss.png", {"train": [x for _, x in self.losses]})
        if self.records:
            write_trace(self.run_dir / "trace.json", self.records, self.devices)
            plot_timeline(self.run_dir / "timeline.png", self.records, self.devices)

    def _summary(self, step: int, wall: float) -> str:
        before = next((e for e in self.evals if e["when"] == "before"), None)
        after = next((e for e in self.evals if e["when"] == "after"), None)
        lines = [
            "# Xronos fine-tuning run",
            "",
            "| | |",
            "|---|---|",
            f"| steps | {step} of {self.total} |",
            f"| wall time | {wall:.1f} s |",
            f"| training tokens/s | {self.tokens / self.train_s:,.0f} |"
            if self.train_s
            else "| training tokens/s | - |",
        ]
        if self.plan_s is not None:
            lines.append(f"| profiling + planning | {self.plan_s:.1f} s |")
        if self.losses:
            lines.append(f"| final train loss | {self.losses[-1][1]:.4f} |")
        for tag, e in (("before", before), ("after", after)):
            if e is not None:
                acc = f"{e['accuracy']:.1%}" if e["accuracy"] is not None else "-"
                lines.append(f"| eval loss / exact match {tag} | {e['eval_loss']:.4f} / {acc} |")
        if self.idle:
            n = len(self.idle[0])
            means = [sum(r[i] for r in self.idle) / len(self.idle) for i in range(n)]
            per = ", ".join(f"{d} {m:.1%}" for d, m in zip(self.devices, means, strict=False))
            lines.append(f"| idle ratio per device | {per} |")
        if self.checkpoint:
            lines.append(f"| last checkpoint | `{self.checkpoint}` |")
        for e in self.events:
            lines.append(
                f"| {e['event'].replace('_', ' ')} at step {e['step']} | {event_text(e)} |"
            )
        if self.plan is not None:
            lines += ["", "## Plan", "", "```", self.plan.table(), "```"]
        lines += [
            "",
            "Files: `metrics.jsonl`, `loss.png`, `timeline.png`, `trace.json`, "
            "`plan.json`, `config.json`, `checkpoints/`.",
        ]
        return "\n".join(lines) + "\n"


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from xronos.errors import UserError

        raise UserError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from None
    return SummaryWriter(str(run_dir / "tensorboard"))
