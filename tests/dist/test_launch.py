"""The launcher: collectives are exact conjugate pairs; a failing, dying or hanging worker
stops the others within a bounded time, and the error names its device; a worker killed by
a signal or silent while the others' collectives fail is a lost device."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm.launch import launch
from xronos.comm.mappings import copy_to_tp, reduce_from_tp
from xronos.errors import DeviceLost, UserError, WorkerError
from xronos.parallel.vocab import vocab_parallel_cross_entropy


def _pairs(ctx: WorkerContext, _: None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)  # the same on every rank
    dy = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + ctx.rank))
    a = x.clone().requires_grad_(True)
    y = copy_to_tp(a, ctx.group)
    y.backward(dy)
    b = (x * (ctx.rank + 1)).requires_grad_(True)
    z = reduce_from_tp(b, ctx.group)
    z.backward(dy)
    return {
        "copy_fwd": y.detach(),
        "copy_bwd": a.grad,
        "reduce_fwd": z.detach(),
        "reduce_bwd": b.grad,
        "dy": dy,
        "x": x,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_conjugate_pairs(world: int) -> None:
    out = run_world(_pairs, world)
    dy_sum = sum(r["dy"] for r in out)
    for rank, r in enumerate(out):
        torch.testing.assert_close(r["copy_fwd"], r["x"])  # identity forward
        torch.testing.assert_close(r["copy_bwd"], dy_sum)  # all-reduced backward
        torch.testing.assert_close(r["reduce_fwd"], r["x"] * sum(range(1, world + 1)))
        torch.testing.assert_close(r["reduce_bwd"], out[rank]["dy"])  # identity backward


def _vocab_ce(ctx: WorkerContext, bounds: list[int]) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, bounds[-1], generator=g)
    targets = torch.randint(0, bounds[-1], (7,), generator=g)
    targets[2] = -100
    v0, v1 = bounds[ctx.rank], bounds[ctx.rank + 1]
    local = logits[:, v0:v1].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, v0, ctx.group)
    loss.backward()
    return float(loss), local.grad


@pytest.mark.parametrize("bounds", [[0, 5, 11], [0, 0, 8, 11], [0, 2, 3, 11]], ids=str)
def test_vocab_parallel_cross_entropy(bounds: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, bounds[-1], generator=g).requires_grad_(True)
    targets = torch.randint(0, bounds[-1], (7,), generator=g)
    targets[2] = -100
    ref = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    ref.backward()
    for rank, (loss, grad) in enumerate(run_world(_vocab_ce, len(bounds) - 1, bounds)):
        # fp32 log-sum-exp combined across ranks: a few ulps of values ~10
        assert loss == pytest.approx(float(ref.detach()), rel=1e-6)
        torch.testing.assert_close(grad, logits.grad[:, bounds[rank] : bounds[rank + 1]])


def _misbehave(ctx: WorkerContext, how: str) -> None:
    if ctx.rank == 1:
        if how == "raise":
            raise RuntimeError("sensor bus fault")
        if how == "user":
            raise UserError("--data x.jsonl: no such file")
        if how == "exit":
            os._exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(600)
    torch.distributed.barrier()  # the others wait in a collective for rank 1


@pytest.mark.parametrize(
    ("how", "kind", "needle"),
    [
        ("raise", WorkerError, "device 'hub' (rank 1) failed: RuntimeError: sensor bus fault"),
        ("user", UserError, "--data x.jsonl: no such file"),
        ("exit", WorkerError, "device 'hub' (rank 1) died: exit code 3"),
        ("kill", DeviceLost, "device 'hub' (rank 1) died: killed by SIGKILL"),
        ("hang", DeviceLost, "device 'hub' (rank 1) stopped answering"),
    ],
)
def test_a_failing_worker_stops_everyone(how: str, kind: type, needle: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(kind) as err:
        launch(_misbehave, [how] * 3, ["gateway", "hub", "car"], timeout_s=5.0)
    assert needle in str(err.value)
    assert type(err.value) is kind  # an error of the worker's own is not a lost device
    if kind is DeviceLost:
        assert (err.value.device, err.value.rank) == ("hub", 1)
    # bounded: the collective timeout (5 s) plus process start-up, never the 600 s sleep
    assert time.monotonic() - t0 < 90


def _sleep_and_tell(ctx: WorkerContext, seconds: float) -> bool:
    time.sleep(seconds)
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_fork_server_outlives_a_sigterm_to_the_process_group() -> None:
    # `timeout` or a service manager's stop sends SIGTERM to every process of the group. The
    # launcher hears its workers' exits through the fork server: had it died of the signal,
    # every worker would read as dead (exit code 255) while finishing its step.
    from multiprocessing import forkserver

    def stop_the_server() -> None:
        deadline = time.monotonic() + 30
        while forkserver._forkserver._forkserver_pid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the workers started (or are starting) meanwhile
        os.kill(forkserver._forkserver._forkserver_pid, signal.SIGTERM)

    stopper = threading.Thread(target=stop_the_server)
    stopper.start()
    try:
        told = run_world(_sleep_and_tell, 2, 3.0)
    finally:
        stopper.join()
    assert told == [True, True]  # and the workers take SIGTERM's default back


def _tell_stop_after(ctx: WorkerContext, seconds: float) -> bool:
    time.sleep(seconds)
    from xronos.comm.stop import requested

    return requested()


def test_a_stop_asked_while_the_workers_start_is_kept() -> None:
    # `stop_when` holds at the first poll, right after the workers were started: the stop
    # signal reaches them while they start (or just after). It is kept as a request, as
    # the training loop reads it, not the signal's default (which ends the process).
    told = launch(
        _tell_stop_after,
        [0.5, 0.5],
        ["a", "b"],
        timeout_s=60,
        stop_signal=signal.SIGUSR1,
        stop_when=lambda: True,
    )
    assert told == [True, True]
