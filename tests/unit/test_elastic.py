"""Carrying on without a lost device, without processes: the survivors' strategy, the
events in metrics.jsonl, and the errors when no one can carry on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from xronos.checkpoint import checkpoint_path
from xronos.comm.mappings import TPGroup
from xronos.emulation import ClusterSpec
from xronos.emulation.cluster import CI_2DEV_MEM_CAP, DeviceSpec
from xronos.errors import DeviceLost, UserError
from xronos.planner.plan import Plan, default_mlp_chunk, default_vocab_chunk
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.profiler.measure import Shape
from xronos.run import elastic
from xronos.run.membership import request_join
from xronos.run.monitor import RunMonitor
from xronos.run.opening import SessionSpec
from xronos.run.worker import WorkerResult
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession


def _spec(strategy: Strategy, plan: Plan | None = None) -> SessionSpec:
    source = ModelSource.from_name("tiny")
    cfg = source.cfg
    shape = Shape(
        cfg=cfg,
        batch_size=2,
        seq_len=8,
        mlp_chunk=default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk=default_vocab_chunk(cfg.vocab_size),
    )
    return SessionSpec(
        source=source, strategy=strategy, optim=OptimConfig(), shape=shape, plan=plan
    )


def _cluster(*names: str, memory: int | None = None) -> ClusterSpec:
    return ClusterSpec("test", tuple(DeviceSpec(n, memory_bytes=memory) for n in names))


def test_tp_even_is_split_evenly_over_the_survivors() -> None:
    old = _spec(Strategy.TP_EVEN, Plan.even(ModelSource.from_name("tiny").cfg, ["a", "b", "c"]))
    new = elastic.survivor_spec(old, _cluster("a", "c"))
    assert new.strategy is Strategy.TP_EVEN and new.plan is not None
    assert new.plan.devices == ("a", "c")


def test_a_given_plan_is_made_anew() -> None:
    given = Plan.even(ModelSource.from_name("tiny").cfg, ["a", "b", "c"])
    new = elastic.survivor_spec(_spec(Strategy.XRONOS, given), _cluster("a", "b"))
    assert new.strategy is Strategy.XRONOS and new.plan is None


@pytest.mark.parametrize(("survivors", "want"), [(2, Strategy.AUTO), (3, Strategy.HYBRID)])
def test_a_hybrid_left_with_two_devices_runs_auto(survivors: int, want: Strategy) -> None:
    # a hybrid needs three devices (two of them on faster links); two can still collaborate
    names = ["a", "b", "c"][:survivors]
    new = elastic.survivor_spec(_spec(Strategy.HYBRID), _cluster(*names))
    assert new.strategy is want and new.hybrid is None and new.pipeline is None


@pytest.mark.parametrize(
    ("memory", "want"), [(None, Strategy.SINGLE), (CI_2DEV_MEM_CAP, Strategy.AUTO)]
)
def test_one_survivor_runs_alone(memory: int | None, want: Strategy) -> None:
    # with a memory cap `auto` checks that the survivor can hold the model alone
    new = elastic.survivor_spec(_spec(Strategy.XRONOS), _cluster("a", memory=memory))
    assert new.strategy is want and new.plan is None


def _prep(tmp_path: Path, *names: str, elastic_on: bool = True) -> Any:
    return SimpleNamespace(
        cfg=SimpleNamespace(elastic=elastic_on),
        cluster=_cluster(*names),
        run_dir=tmp_path,
        job=SimpleNamespace(session=_spec(Strategy.XRONOS)),
    )


def _events(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" in r]


DONE = WorkerResult(10, False, None, {}, [], [], members=(0,))
"""What every worker returns at the run's end (the fake's ``"done"``)."""


def _script(
    monkeypatch: pytest.MonkeyPatch,
    outcomes: list[BaseException | str],
    monitor: RunMonitor | None = None,
) -> list[list[str]]:
    """launch_job gives ``outcomes`` in turn (``"join"``: a lost device asks to come back
    after a step, the workers stop; ``"change"`` / ``"balance"``: the workers stopped to
    start again, a device's speed changed, or the first plan was out of balance with its
    first steps, the slow device's compute 1.5 × its prediction); a survivor's job resumes
    from step 4, one started again from step 9. Returns, per ``rejoined``, the devices
    given back and the profiles it was given (by name; None: profile anew)."""
    calls = iter(outcomes)
    rejoins: list[tuple[list[str], dict[str, DeviceProfile] | None]] = []

    def launch_job(prep: Any, on_event: Any, stop_when: Any, lost: Any) -> list[Any]:
        out = next(calls)
        if isinstance(out, BaseException):
            raise out
        on_event(
            0,
            {
                "kind": "plan",
                "plan": Plan.single(
                    ModelSource.from_name("tiny").cfg, prep.cluster.devices[0].name
                ).to_dict(),
                "seconds": 0.0,
                "given": True,
            },
        )
        if out == "join":
            assert lost == ["slow"] and not stop_when()  # nothing asked yet
            request_join(prep.run_dir, "slow")
            assert not stop_when()  # no step done yet by these workers: not safe to stop
            assert monitor is not None
            monitor.last_step += 1  # a step done
            assert stop_when()
            return [WorkerResult(5, True, None, {}, [], [], members=(0,))]  # to take it back
        if out in ("change", "balance"):
            offer = {"why": out, "relative": {"fast": 1.0, "slow": 1.5}}
            return [WorkerResult(6, True, None, {}, [], [], members=(0,), restage=offer)]
        return [DONE]

    def survivors(prep: Any, rank: int, known: Any) -> tuple[Any, int]:
        devices = tuple(d for r, d in enumerate(prep.cluster.devices) if r != rank)
        return SimpleNamespace(**{**vars(prep), "cluster": ClusterSpec("test", devices)}), 4

    def rejoined(
        first: Any, prep: Any, back: list[str], known: dict[str, DeviceProfile] | None = None
    ) -> tuple[Any, int]:
        rejoins.append((back, known))
        return first, 9

    known = {n: DeviceProfile(name=n, segments=_CURVES, replicated_s=0.1) for n in ("fast", "slow")}
    monkeypatch.setattr(elastic, "launch_job", launch_job)
    monkeypatch.setattr(elastic, "survivors", survivors)
    monkeypatch.setattr(elastic, "rejoined", rejoined)
    monkeypatch.setattr(elastic, "known_profiles", lambda prep, monitor: known)
    return rejoins


_CURVES = {s: CostCurve(0.01, 0.002) for s in ("attn", "mlp", "vocab")}


def _monitor(run: Path, last_step: int) -> RunMonitor:
    monitor = RunMonitor(run, 10, lambda generated: None)
    monitor.last_step = last_step
    return monitor


def test_a_lost_device_that_asks_back_is_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    monitor = _monitor(tmp_path, 7)
    lost = DeviceLost("slow", 1, "died: killed by SIGKILL")
    rejoins = _script(monkeypatch, [lost, "join", "done"], monitor)
    # request_join looks for a live worker in devices.json: this process stands for one
    rows = [{"name": "fast", "rank": 0, "pid": os.getpid()}]
    (tmp_path / "devices.json").write_text(json.dumps({"devices": rows, "lost": ["slow"]}))
    results, prep = elastic.launch_elastic(_prep(tmp_path, "fast", "slow"), monitor)
    assert results == [DONE] and [d.name for d in prep.cluster.devices] == ["fast", "slow"]
    assert rejoins == [(["slow"], None)]
    kinds = [(e["event"], e["step"]) for e in _events(tmp_path)]
    assert kinds == [("device_lost", 7), ("resumed", 4), ("device_joined", 9), ("resumed", 9)]
    joined, resumed = _events(tmp_path)[2:]
    assert joined["device"] == "slow" and resumed["recomputed_steps"] == 0
    assert not list((tmp_path / "join").iterdir())  # the request was taken


def test_events_of_a_loss_and_the_resumption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _script(monkeypatch, [DeviceLost("slow", 1, "died: killed by SIGKILL"), "done"])
    monitor = _monitor(tmp_path, 7)
    results, prep = elastic.launch_elastic(_prep(tmp_path, "fast", "slow"), monitor)
    monitor.finish(10)
    assert results == [DONE] and [d.name for d in prep.cluster.devices] == ["fast"]
    lost, resumed = _events(tmp_path)
    assert lost == {
        "event": "device_lost",
        "step": 7,
        "device": "slow",
        "rank": 1,
        "reason": "died: killed by SIGKILL",
    }
    assert resumed == {
        "event": "resumed",
        "step": 4,
        "devices": ["fast"],
        "strategy": "single",
        "recomputed_steps": 3,
    }
    summary = (tmp_path / "summary.md").read_text()
    assert "device lost at step 7" in summary and "resumed at step 4" in summary


def test_a_pipeline_that_stopped_to_plan_again_starts_again_on_its_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rejoins = _script(monkeypatch, ["change", "done"])
    monitor = _monitor(tmp_path, 6)
    results, _ = elastic.launch_elastic(_prep(tmp_path, "fast", "slow"), monitor)
    # the same devices, no one back, profiled anew (their speeds changed)
    assert results == [DONE] and rejoins == [([], None)]
    [resumed] = _events(tmp_path)
    assert resumed["event"] == "resumed" and resumed["step"] == 9
    assert resumed["recomputed_steps"] == 0  # the checkpoint of the step it stopped at


def test_a_pipeline_out_of_balance_plans_again_from_its_profiles_scaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rejoins = _script(monkeypatch, ["balance", "done"])
    elastic.launch_elastic(_prep(tmp_path, "fast", "slow"), _monitor(tmp_path, 6))
    [(back, known)] = rejoins
    assert back == [] and known is not None
    # each device's profile scaled by what its first steps showed: no profiling again
    units = {"attn": 3, "mlp": 5, "vocab": 7}
    slow, fast = known["slow"].step_time(units), known["fast"].step_time(units)
    assert slow == pytest.approx(1.5 * fast) and fast == pytest.approx(
        0.1 + 3 * 0.01 + 0.002 * 15
    )  # as profiled


def test_a_run_started_again_caches_its_first_starts_profiles(tmp_path: Path) -> None:
    # a pipeline started again because a device slowed: the new start's profiles met the
    # slowed device, so the next run must not plan from them; the elastic paths read the
    # newest (what the devices run at now)
    monitor = _monitor(tmp_path, 0)
    plan = {"devices": ["fast", "slow"], "layer_ranges": [[0, 3], [3, 4]]}
    plan |= {"predicted_stage_s": [], "num_microbatches": 2}
    for speed in (0.4, 0.2):
        measured = [{"name": "slow", "speed": speed}]
        monitor.on_event(
            0, {"kind": "pipeline", "plan": plan, "strategy": "pp-1f1b", "measured": measured}
        )
    assert monitor.first_measured == [{"name": "slow", "speed": 0.4}]
    assert monitor.measured == [{"name": "slow", "speed": 0.2}]


def test_survivors_that_cannot_hold_the_model_stop_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_fit = UserError("auto: no strategy fits the devices' memory; add memory or devices")
    _script(monkeypatch, [DeviceLost("slow", 1, "died: killed by SIGKILL"), no_fit])
    with pytest.raises(UserError) as err:
        elastic.launch_elastic(_prep(tmp_path, "fast", "slow"), _monitor(tmp_path, 7))
    assert str(err.value) == f"after losing 'slow', the remaining devices cannot carry on: {no_fit}"


def test_the_last_device_lost_ends_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _script(monkeypatch, [DeviceLost("fast", 0, "died: killed by SIGKILL")])
    with pytest.raises(DeviceLost, match="killed by SIGKILL; no device is left"):
        elastic.launch_elastic(_prep(tmp_path, "fast"), _monitor(tmp_path, 7))


def test_no_elastic_keeps_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lost = DeviceLost("slow", 1, "died: killed by SIGKILL")
    _script(monkeypatch, [lost])
    prep = _prep(tmp_path, "fast", "slow", elastic_on=False)
    with pytest.raises(DeviceLost) as err:
        elastic.launch_elastic(prep, _monitor(tmp_path, 7))
    assert err.value is lost and str(lost) == "device 'slow' (rank 1) died: killed by SIGKILL"
    assert not (tmp_path / "metrics.jsonl").read_text()


def _rewrite_meta(ckpt: Path, **fields: Any) -> None:
    """Change ``meta.json`` of ``ckpt`` (a field set to None is removed), keeping the
    completion marker's file sizes true."""
    meta = json.loads((ckpt / "meta.json").read_text())
    for key, value in fields.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    complete = json.loads((ckpt / "COMPLETE").read_text())
    complete["files"] = {n: (ckpt / n).stat().st_size for n in complete["files"]}
    (ckpt / "COMPLETE").write_text(json.dumps(complete))


def test_a_checkpoint_resumes_unless_it_lacks_optimizer_state(tmp_path: Path) -> None:
    spec = _spec(Strategy.SINGLE)
    session = TPSession(
        spec.source, Plan.single(spec.source.cfg), TPGroup(), spec.optim, Strategy.SINGLE
    )
    data = RandomBatches(spec.source.cfg.vocab_size, batch_size=2, seq_len=8, seed=1)
    session.step(data.next_step())
    ckpt = checkpoint_path(tmp_path, 1)
    session.save(ckpt, {"strategy": "pp-1f1b"})  # as a pipeline's, which now holds AdamW's
    assert elastic.resumable(tmp_path) == ckpt
    _rewrite_meta(ckpt, optimizer=False)
    assert elastic.resumable(tmp_path) is None
    _rewrite_meta(ckpt, optimizer=None)  # an older Xronos: a pipeline's held none
    assert elastic.resumable(tmp_path) is None
    _rewrite_meta(ckpt, extra={"strategy": "xronos"})  # ... a TP run's did
    assert elastic.resumable(tmp_path) == ckpt
