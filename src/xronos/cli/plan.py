"""``xronos plan``: the planner as a command — profiles in, a plan (table + JSON) out."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from xronos.cli.common import add_comm_dtype_arg
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner import plan_even, plan_pipeline, plan_tp, predict
from xronos.planner.auto import plan_auto
from xronos.planner.profile import DeviceProfile, load_profiles, on_the_wire
from xronos.run.opening import wire_bytes
from xronos.train.source import ModelSource
from xronos.utils import atomic_write_text


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="plan the split of every segment from a profile")
    p.add_argument("--profile", required=True, help="profile.json from `xronos profile`")
    p.add_argument("--model", help="preset or directory (default: the profiled model)")
    p.add_argument(
        "--strategy",
        default="xronos",
        choices=("xronos", "tp-even", "pp", "auto"),
        help="xronos (default), Megatron's even split, the pipeline stage plan, or auto: "
        "every strategy predicted (communication included) and the fastest chosen",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="accumulation batches per optimizer step (auto: pipelines cut them into "
        "micro-batches)",
    )
    add_comm_dtype_arg(p)
    p.add_argument("--out", help="write the plan as JSON here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    measured, meta = load_profiles(args.profile)
    profiles = on_the_wire(measured, wire_bytes(args.comm_dtype))
    model = args.model or meta.get("model")
    if not model:
        raise UserError(f"{args.profile} does not name its model; pass --model")
    cfg = ModelSource.from_name(model).cfg
    chunks = {"mlp_chunk": meta.get("mlp_chunk"), "vocab_chunk": meta.get("vocab_chunk")}
    if args.strategy == "auto":
        text = _auto(args, cfg, profiles, meta, chunks)
    elif args.strategy == "pp":
        from xronos.pipeline.costs import pipeline_microbatches, stage_costs
        from xronos.planner.pipesearch import update_s

        m = pipeline_microbatches(int(meta.get("batch_size", 1)), len(profiles), None)
        costs = stage_costs(profiles, cfg, m)
        pplan = plan_pipeline(cfg.num_layers, costs, m)
        pplan = dataclasses.replace(pplan, update_s=update_s(pplan, costs))
        print(pplan.table())
        text = pplan.to_json()
    else:
        plan = (
            plan_tp(cfg, profiles, **chunks)
            if args.strategy == "xronos"
            else plan_even(cfg, profiles)
        )
        pred = predict(plan, profiles)
        print(plan.table())
        print(
            f"predicted step {pred['step_time_s']:.4f} s, idle ratio mean "
            f"{pred['idle_ratio_mean']:.1%} (max {pred['idle_ratio_max']:.1%})"
        )
        text = plan.to_json()
    if args.out:
        atomic_write_text(Path(args.out), text)
        print(f"wrote {args.out}")
    return 0


def _auto(
    args: argparse.Namespace,
    cfg: ModelConfig,
    profiles: list[DeviceProfile],
    meta: dict[str, Any],
    chunks: dict[str, Any],
) -> str:
    """Print every candidate; the chosen plan's JSON (every candidate's next to ``--out``)."""
    if "batch_size" not in meta or "seq_len" not in meta:
        raise UserError(f"{args.profile} does not record its batch shape; re-run `xronos profile`")
    if args.grad_accum < 1:
        raise UserError(f"--grad-accum {args.grad_accum}: must be at least 1")
    choice = plan_auto(
        cfg,
        profiles,
        batch_size=int(meta["batch_size"]),
        seq_len=int(meta["seq_len"]),
        grad_accum=args.grad_accum,
        **chunks,
    )
    best = choice.chosen
    print(choice.table())
    print(f"chosen: {best.strategy}, predicted {best.predicted_step_s:.4f} s per step")
    if args.out:
        out = Path(args.out)
        every = out.with_name(out.stem + ".candidates.json")
        atomic_write_text(every, json.dumps(choice.to_dict(), indent=2))
        print(f"wrote {every}")
    return json.dumps(best.plan.to_dict() if best.plan is not None else {}, indent=2)
