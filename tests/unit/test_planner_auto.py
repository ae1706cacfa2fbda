"""plan_auto: every strategy predicted from synthetic profiles, the fastest feasible chosen."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.cli import main
from xronos.config import ModelConfig, small
from xronos.errors import UserError
from xronos.planner import SEGMENTS, Plan
from xronos.planner.auto import AutoChoice, Candidate, plan_auto
from xronos.planner.comm import LinkModel, tp_traffic
from xronos.planner.hybrid import HybridPlan, tp_stage
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.profile import CostCurve, DeviceProfile, on_the_wire, save_profiles

PER_UNIT = {"attn": 0.02, "mlp": 0.004, "vocab": 0.001}
B, S = 8, 128
GBIT, MBIT = 1.25e8, 1.25e5  # bytes per second


def profile(
    cfg: ModelConfig,
    name: str,
    speed: float,
    bw: float,
    *,
    lat: float = 1e-4,
    memory: int = 0,
    unit_bytes: dict[str, int] | None = None,
    rep: float = 0.05,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(0.0, PER_UNIT[s] / speed) for s in SEGMENTS},
        replicated_s=rep / speed,
        link=LinkModel(lat, bw),
        traffic=tp_traffic(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, tokens=B * S),
        memory_bytes=memory,
        unit_bytes=unit_bytes or {},
    )


def auto(cfg: ModelConfig, profiles: list[DeviceProfile], **kw: int) -> AutoChoice:
    return plan_auto(cfg, profiles, batch_size=kw.pop("batch_size", B), seq_len=S, **kw)


def of(choice: AutoChoice, strategy: str) -> list[Candidate]:
    return [c for c in choice.candidates if c.strategy == strategy]


def test_very_slow_links_choose_the_fastest_device_alone() -> None:
    cfg = small()
    ps = [profile(cfg, "pi", 0.4, 2 * MBIT), profile(cfg, "nuc", 1.0, 2 * MBIT)]
    choice = auto(cfg, ps)
    best = choice.chosen
    assert best.strategy == "single" and best.devices == (1,)
    assert isinstance(best.plan, Plan) and best.plan.devices == ("nuc",)
    units = {s: sum(best.plan.split(s)) for s in SEGMENTS}  # the whole model
    assert best.predicted_step_s == pytest.approx(ps[1].step_time(units))
    tp = of(choice, "xronos")[0]
    assert tp.feasible and tp.predicted_step_s > best.predicted_step_s
    assert "transfer" in tp.why and "*" in choice.table().splitlines()[1]


def test_fast_links_choose_tp_over_both() -> None:
    cfg = small()
    ps = [profile(cfg, "nuc", 1.0, 100 * GBIT, lat=1e-6), profile(cfg, "pi", 0.4, 100 * GBIT)]
    best = auto(cfg, ps).chosen
    assert best.strategy == "xronos" and best.devices == (0, 1)
    assert isinstance(best.plan, Plan) and best.plan.world_size == 2


def test_a_slower_link_raises_tp_and_leaves_single_unchanged() -> None:
    cfg = small()
    fast = auto(cfg, [profile(cfg, "a", 1.0, GBIT), profile(cfg, "b", 0.4, GBIT)])
    slow = auto(cfg, [profile(cfg, "a", 1.0, GBIT / 10), profile(cfg, "b", 0.4, GBIT / 10)])
    assert of(slow, "single")[0].predicted_step_s == of(fast, "single")[0].predicted_step_s
    assert of(slow, "xronos")[-1].predicted_step_s > of(fast, "xronos")[-1].predicted_step_s
    assert of(slow, "tp-even")[0].predicted_step_s > of(fast, "tp-even")[0].predicted_step_s


def test_a_device_that_costs_more_in_transfer_than_it_saves_leaves_tp() -> None:
    cfg = small()
    # Two fast devices on a fast link, and a tenth-speed one: its ~5 % of the compute
    # is less than what a third rank adds to every all-reduce (4 rounds instead of 2).
    # No replicated work, so that crawl's units are a pure compute saving.
    ps = [
        profile(cfg, "a", 1.0, GBIT, rep=0.0),
        profile(cfg, "b", 1.0, GBIT, rep=0.0),
        profile(cfg, "crawl", 0.1, GBIT, rep=0.0),
    ]
    best, everyone = of(auto(cfg, ps), "xronos")
    assert best.devices == (0, 1) and everyone.devices == (0, 1, 2)
    assert best.predicted_step_s < everyone.predicted_step_s
    assert isinstance(everyone.plan, Plan) and isinstance(best.plan, Plan)
    assert sum(everyone.plan.split("mlp")[:2]) < sum(everyone.plan.split("mlp"))  # crawl works
    assert best.compute_s is not None and everyone.compute_s is not None
    assert best.transfer_s is not None and everyone.transfer_s is not None
    saving = best.compute_s - everyone.compute_s
    assert 0 < saving < everyone.transfer_s - best.transfer_s  # saves, but less than it costs


def test_pipeline_puts_the_head_on_the_fast_device_and_beats_rank_order() -> None:
    cfg = dataclasses.replace(small(), num_layers=8)
    # Rank order puts the fast device first, so the fixed order gives the head to the slow one.
    ps = [profile(cfg, "fast", 1.0, GBIT), profile(cfg, "slow", 0.4, GBIT)]
    pp = of(auto(cfg, ps), "pp-1f1b")[0]
    assert isinstance(pp.plan, PipelinePlan)
    assert pp.plan.stage_ranks[-1] == 0 and pp.plan.devices[-1] == "fast"
    from xronos.pipeline.costs import stage_costs
    from xronos.planner import plan_pipeline

    m = pp.plan.num_microbatches
    fixed = plan_pipeline(cfg.num_layers, stage_costs(ps, cfg, m), m)
    assert fixed.devices[-1] == "slow"
    assert pp.predicted_step_s < fixed.predicted_step_s


def test_memory_makes_single_infeasible() -> None:
    cfg = small()
    ub = {"attn": 1000, "mlp": 1000, "vocab": 1000}
    whole = 1000 * (cfg.num_kv_heads + 256 + 256)  # more than every unit of the model needs
    ps = [
        profile(cfg, "nuc", 1.0, MBIT, memory=10_000, unit_bytes=ub),  # far below the state
        profile(cfg, "pi", 0.4, MBIT, memory=whole, unit_bytes=ub),
    ]
    choice = auto(cfg, ps)
    nuc = of(choice, "single")[0]
    assert not nuc.feasible and nuc.plan is None and "MiB" in nuc.why
    assert choice.chosen.devices != (0,) or choice.chosen.strategy != "single"
    assert "infeasible" in choice.table()
    only = auto(cfg, ps[:1])
    with pytest.raises(UserError, match="no strategy fits"):
        _ = only.chosen
    assert "infeasible" in only.table()  # the table still says why


def test_hybrid_keeps_tp_inside_the_fast_pair_and_pipelines_across() -> None:
    cfg = dataclasses.replace(small(), num_layers=16)
    ps = [
        profile(cfg, "a", 1.0, 100 * GBIT, lat=1e-5),
        profile(cfg, "b", 1.0, 100 * GBIT, lat=1e-5),
        profile(cfg, "c", 1.0, GBIT),
    ]
    choice = auto(cfg, ps)
    best = choice.chosen
    assert best.strategy == "hybrid", choice.table()
    assert isinstance(best.plan, HybridPlan)
    assert (0, 1) in best.plan.groups and (2,) in best.plan.groups
    assert best.plan.tp.devices == ("a", "b")
    assert "a+b" in choice.table()
    assert json.loads(json.dumps(best.plan.to_dict()))["groups"] == [
        list(g) for g in best.plan.groups
    ]


def test_the_choice_is_the_fastest_feasible() -> None:
    cfg = small()
    ps = [profile(cfg, "a", 1.0, 10 * MBIT), profile(cfg, "b", 0.7, 10 * MBIT)]
    choice = auto(cfg, ps, grad_accum=2)
    feasible = [c.predicted_step_s for c in choice.candidates if c.feasible]
    assert choice.chosen.predicted_step_s == min(feasible)
    d = choice.to_dict()
    assert d["candidates"][d["chosen"]]["strategy"] == choice.chosen.strategy


@settings(max_examples=15, deadline=None)
@given(st.floats(0.1, 1.0), st.floats(1e5, 1e10), st.integers(1, 4))
def test_auto_is_pure_and_never_worse_than_the_fastest_device(
    speed: float, bw: float, accum: int
) -> None:
    cfg = small()
    ps = [profile(cfg, "a", 1.0, bw), profile(cfg, "b", speed, bw)]
    first = auto(cfg, ps, grad_accum=accum)
    assert auto(cfg, ps, grad_accum=accum) == first  # same inputs, same answer
    solo = min(c.predicted_step_s for c in of(first, "single"))
    assert first.chosen.predicted_step_s <= solo


def test_predictions_start_no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the planner started a process")

    monkeypatch.setattr(multiprocessing.Process, "start", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    cfg = small()
    auto(cfg, [profile(cfg, "a", 1.0, GBIT), profile(cfg, "b", 0.4, MBIT)])


def test_bad_batch_shape_is_one_clear_line() -> None:
    cfg = small()
    with pytest.raises(UserError, match="batch_size=0"):
        auto(cfg, [profile(cfg, "a", 1.0, GBIT)], batch_size=0)


def test_xronos_plan_auto_prints_the_table_and_writes_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small()
    ps = [profile(cfg, "nuc", 1.0, 2 * MBIT), profile(cfg, "pi", 0.4, 2 * MBIT)]
    prof, out = tmp_path / "profile.json", tmp_path / "plan.json"
    save_profiles(str(prof), ps, {"model": "small", "batch_size": B, "seq_len": S})
    assert main(["plan", "--profile", str(prof), "--strategy", "auto", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "strategy" in printed and "chosen: single" in printed and "xronos" in printed
    assert Plan.from_json(out.read_text()).devices == ("nuc",)
    every = json.loads((tmp_path / "plan.candidates.json").read_text())
    assert every["candidates"][every["chosen"]]["strategy"] == "single"


def test_bf16_payloads_halve_what_the_pipeline_sends() -> None:
    """Priced on the wire in bf16 (``--comm-dtype bf16``, as the runner sends them), a
    pipeline's messages carry half the bytes: on a slow link its step is shorter by half
    its transfer, while the device alone is unchanged."""
    cfg = small()
    ps = [profile(cfg, "fast", 1.0, 10 * MBIT), profile(cfg, "slow", 0.4, 10 * MBIT)]
    fp32, bf16 = auto(cfg, ps), auto(cfg, on_the_wire(ps, 2))
    assert of(bf16, "single")[0].predicted_step_s == of(fp32, "single")[0].predicted_step_s
    wide, narrow = of(fp32, "pp-1f1b")[0], of(bf16, "pp-1f1b")[0]
    assert isinstance(wide.plan, PipelinePlan) and isinstance(narrow.plan, PipelinePlan)
    assert narrow.predicted_step_s < wide.predicted_step_s
    # the same plan priced both ways: every stage's send costs half the bytes' time
    from xronos.pipeline.costs import stage_costs

    m = wide.plan.num_microbatches
    sends = [c.send_s for c in stage_costs(ps, cfg, m)]
    halves = [c.send_s for c in stage_costs(on_the_wire(ps, 2), cfg, m)]
    lat = 2 * 2 * 1e-4  # there and back, each over two links' latency
    assert sends[0] > 0 and halves[0] - lat == pytest.approx((sends[0] - lat) / 2)


def test_xronos_plan_prices_the_comm_dtype(tmp_path: Path) -> None:
    """``xronos plan --comm-dtype`` prices the activations as ``xronos finetune`` would send
    them: fp32 doubles every collaboration's bytes, so each predicts a longer step."""
    cfg = small()
    ps = [profile(cfg, "nuc", 1.0, 10 * MBIT), profile(cfg, "pi", 0.4, 10 * MBIT)]
    prof = tmp_path / "profile.json"
    save_profiles(str(prof), ps, {"model": "small", "batch_size": B, "seq_len": S})
    steps = {}
    for dtype in ("bf16", "fp32"):
        out = tmp_path / f"{dtype}.json"
        argv = ["plan", "--profile", str(prof), "--strategy", "auto", "--out", str(out)]
        assert main([*argv, "--comm-dtype", dtype]) == 0
        every = json.loads((tmp_path / f"{dtype}.candidates.json").read_text())["candidates"]
        steps[dtype] = {(c["strategy"], tuple(c["devices"])): c["predicted_step_s"] for c in every}
    for key, fp32 in steps["fp32"].items():
        if key[0] == "single":
            assert steps["bf16"][key] == fp32
        elif key[0] in ("xronos", "pp-1f1b"):
            assert steps["bf16"][key] < fp32, key


def test_a_tp_stage_pays_its_collectives_latency_per_micro_batch() -> None:
    """Cutting a batch in two halves the bytes of the TP stage's all-reduces, not their
    number: each micro-batch pays every all-reduce's latency (4 per layer, and the
    vocabulary's), so the stage's fixed part per micro-batch is at least that."""
    cfg = small()
    lat = 1e-3
    ps = [profile(cfg, "a", 1.0, GBIT, lat=lat), profile(cfg, "b", 1.0, GBIT, lat=lat)]
    kwargs = {"mlp_chunk": 32, "vocab_chunk": 32, "replicated_share": None}
    stage, _ = tp_stage(cfg, ps, (0, 1), kwargs)
    # an all-reduce of two ranks waits at least both links' one-way latency
    assert stage.costs.layer_split_s >= 4 * 2 * lat
    assert stage.costs.head_split_s >= 2 * lat
    assert stage.costs.layer_split_s < stage.costs.layer_s  # the bytes and compute scale


def test_hybrids_price_the_tied_rows_exchange() -> None:
    cfg = dataclasses.replace(small(), num_layers=16)
    ps = [
        profile(cfg, "a", 1.0, 100 * GBIT, lat=1e-5),
        profile(cfg, "b", 1.0, 100 * GBIT, lat=1e-5),
        dataclasses.replace(profile(cfg, "c", 1.0, GBIT), tied_grad_bytes=1),
    ]
    hybrids = [c for c in auto(cfg, ps).candidates if c.strategy == "hybrid" and c.feasible]
    assert hybrids
    for c in hybrids:
        assert isinstance(c.plan, HybridPlan)
        # two messages of the step's rows (B·S tokens × H fp32) over a 1 Gbit/s link
        rows = 4 * min(cfg.vocab_size, B * S) * cfg.hidden_size
        assert c.plan.pipeline.step_extra_s >= 2 * rows / GBIT
