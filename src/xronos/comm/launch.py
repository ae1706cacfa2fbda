"""Local launcher: one process per device, a gloo process group on loopback (or on the
emulated network's bridge).

The parent process owns the rendezvous: a c10d ``TCPStore`` built on a socket that the
parent has already bound to ``127.0.0.1``, or to the bridge address when devices live in
network namespaces (TCPStore alone would listen on every interface). Each worker joins
its device's resource limits first (``slot.enter()``), then the store, then the gloo group,
with explicit timeouts on every collective; a worker given link latencies carries them in
its group (``TPGroup.links``, :mod:`xronos.comm.links`).

The parent watches the workers: the first one to fail -- an exception, a non-zero exit,
a signal -- stops all the others, and the error names that device and the cause. A
hung collective ends by the gloo timeout inside the worker, which is then such a failure.
A device *lost* -- its worker killed by a signal, or silent while the others' collectives
fail (it stopped answering) -- raises :class:`~xronos.errors.DeviceLost`, after which the
caller may carry on with the others.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from xronos.comm import stop
from xronos.comm.failures import SILENCE_GRACE_S, raise_died, raise_root_cause, silent_peer
from xronos.comm.groups import init_world
from xronos.comm.heap import keep_freed_memory
from xronos.comm.links import LinkDelays
from xronos.comm.mappings import TPGroup
from xronos.comm.start import start_method
from xronos.errors import DeviceLost, UserError, WorkerError


class Slot(Protocol):
    """Anything that puts the calling process inside its device's limits."""

    def enter(self) -> None: ...


@dataclass
class WorkerContext:
    """What a worker function receives besides its own arguments."""

    rank: int
    world_size: int
    device: str
    group: TPGroup
    timeout_s: float
    devices: tuple[str, ...] = field(default_factory=tuple)
    channel: Any = None

    def emit(self, event: dict[str, Any]) -> None:
        """Send a progress event to the parent's ``on_event`` callback (rank 0 usually)."""
        if self.channel is not None:
            self.channel.put(("event", self.rank, event))


WorkerFn = Callable[[WorkerContext, Any], Any]


def _bound_loopback_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(256)
    return sock


def init_gloo(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    ifname: str | None = "lo",
    links: LinkDelays | None = None,
) -> TPGroup:
    """Join the store at ``host:port`` and create the gloo group (every collective is
    bounded by ``timeout_s``; ``links`` adds each rank's link latency to its messages)."""
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    init_world(store, rank, world_size, timeout_s)
    return TPGroup.from_default(links)


def _worker_main(
    rank: int,
    devices: tuple[str, ...],
    host: str,
    port: int,
    fn: WorkerFn,
    arg: Any,
    results: Any,
    slot: Slot | None,
    timeout_s: float,
    latency_s: tuple[float, ...] | None = None,
    bandwidth_bps: tuple[float | None, ...] | None = None,
    env: dict[str, str] | None = None,
    stop_signal: int | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    if stop_signal is not None:  # from now on a stop is a request; the parent holds its
        stop.listen(stop_signal, signal.SIGTERM)  # ask until this worker says it is up
        results.put(("up", rank, None))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server's ignores it
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    world = len(devices)
    keep_freed_memory()
    try:
        if slot is not None:
            slot.enter()
        _warm_imports()
        links = None
        if (latency_s and any(latency_s)) or bandwidth_bps is not None:
            links = LinkDelays(latency_s or (0.0,) * world, bandwidth_bps=bandwidth_bps)
        group = (
            init_gloo(rank, world, host, port, timeout_s, links=links) if world > 1 else TPGroup()
        )
        ctx = WorkerContext(rank, world, devices[rank], group, timeout_s, devices, results)
        # Pickled by value here: torch's queue reducers would pass tensors by shared file
        # descriptor, which is gone once this process exits.
        results.put(("ok", rank, pickle.dumps(fn(ctx, arg))))
    except UserError as e:
        _say_last(results, ("user", rank, str(e)))
        raise SystemExit(2) from None
    except BaseException as e:
        tb = traceback.format_exc(limit=-6)
        kind = "comm" if _collective_failed(e) else "error"
        _say_last(results, (kind, rank, f"{type(e).__name__}: {_first_line(e)}\n{tb}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _say_last(results: Any, message: tuple[str, int, str]) -> None:
    """Send a failure to the parent, and wait until it is written: before this worker's
    connections close, so that it reaches the parent ahead of the failures it causes in
    the others' collectives."""
    results.put(message)
    results.close()
    results.join_thread()


def _warm_imports() -> None:
    """Import what torch imports lazily on first use: building a model on the meta device
    (reference ops) and the first optimizer (the compiler stack) cost seconds each on a
    slow device. Paid at start-up, so that no measurement includes them (nothing to do in
    a worker forked from a server that did it, :mod:`xronos.comm.warm`)."""
    import xronos.comm.warm  # noqa: F401


def _collective_failed(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective (a timeout, a closed connection): a
    ``DistError``, or an error raised inside ``torch.distributed`` (where checks such as
    the monitored barrier of ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` raise ``RuntimeError``)."""
    if isinstance(e, dist.DistError):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return isinstance(e, RuntimeError) and f"torch{os.sep}distributed{os.sep}" in where


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else repr(e)


def launch(
    fn: WorkerFn,
    args: Sequence[Any],
    devices: Sequence[str],
    *,
    slots: Sequence[Slot | None] | None = None,
    timeout_s: float = 120.0,
    host: str = "127.0.0.1",
    on_start: Callable[[int, int], None] | None = None,
    on_event: Callable[[int, dict[str, Any]], None] | None = None,
    stop_signal: int | None = None,
    stop_when: Callable[[], bool] | None = None,
    latency_s: Sequence[float] | None = None,
    bandwidth_bps: Sequence[float | None] | None = None,
    forked: bool = True,
) -> list[Any]:
    """Run ``fn(ctx, args[rank])`` in one process per device and return the results.

    Args:
        fn: a module-level function (workers import it by name).
        args: one picklable argument per rank.
        devices: device names, in rank order; they name failures.
        slots: per-rank resource limits entered first thing in the worker, or None.
        timeout_s: bound on every collective and on the rendezvous.
        host: address the store listens on; loopback unless a multi-host address is given.
        on_start: called as ``on_start(rank, pid)`` once each worker has started.
        on_event: called as ``on_event(rank, event)`` for each ``ctx.emit(event)``.
        stop_signal: on the first Ctrl-C, send this signal to every worker and keep
            collecting (workers that handle it stop cleanly, e.g. after a checkpoint); a
            second Ctrl-C stops them at once. None: the first Ctrl-C stops them at once.
            Each worker takes it, and SIGTERM, as a request (:mod:`xronos.comm.stop`) from
            its first instruction and then says so; one that is still starting gets the
            signal once it has.
        stop_when: polled while the workers run (after each event, and five times a
            second); once it returns True, ``stop_signal`` is sent as for a Ctrl-C.
        latency_s: one-way latency of each device's link, rank order, added to every
            message in the communication layer (:mod:`xronos.comm.links`); None: none.
        bandwidth_bps: rate (bit/s) of each device's link, rank order (None entries:
            unlimited), charged to every message in the communication layer where the
            kernel cannot shape it; None: none.
        forked: start the workers from a process that has torch loaded already
            (:func:`~xronos.comm.start.start_method`); False: each imports it anew in its
            own interpreter, inside its limits (a memory cap then charges torch's pages).
    Raises:
        UserError: a worker found a mistake in the user's input.
        WorkerError: a worker failed or died; the message names its device.
    """
    devices = tuple(devices)
    world = len(devices)
    latencies = tuple(float(x) for x in latency_s) if latency_s is not None else None
    if latencies is not None and len(latencies) != world:
        raise ValueError(f"{len(latencies)} link latencies for {world} devices")
    rates = tuple(bandwidth_bps) if bandwidth_bps is not None else None
    if rates is not None and len(rates) != world:
        raise ValueError(f"{len(rates)} link rates for {world} devices")
    ctx = start_method(fn.__module__, forked)
    env = dict(os.environ)  # a forked worker gets the server's: it takes this one instead
    results: Any = ctx.Queue()
    sock = _bound_loopback_socket(host)
    port = sock.getsockname()[1]
    store = dist.TCPStore(  # takes ownership of the bound socket's descriptor
        host,
        port,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    procs = []
    try:
        for rank in range(world):
            slot = slots[rank] if slots is not None else None
            p = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    devices,
                    host,
                    port,
                    fn,
                    args[rank],
                    results,
                    slot,
                    timeout_s,
                    latencies,
                    rates,
                    env,
                    stop_signal,
                ),
                name=f"xronos-{devices[rank]}",
                daemon=False,
            )
            p.start()
            procs.append(p)
            if on_start is not None and p.pid is not None:
                on_start(rank, p.pid)
        return _collect(procs, results, devices, on_event, stop_signal, timeout_s, stop_when)
    finally:
        _stop_all(procs)
        results.close()
        del store


def _collect(
    procs: list[Any],
    results: Any,
    devices: tuple[str, ...],
    on_event: Callable[[int, dict[str, Any]], None] | None,
    stop_signal: int | None = None,
    timeout_s: float = 120.0,
    stop_when: Callable[[], bool] | None = None,
) -> list[Any]:
    out: dict[int, Any] = {}
    up: set[int] = set()  # workers that take the stop signal as a request (said "up")
    sent: list[int] = []  # the stop signal, once sent: a worker that comes up later gets it

    def send_stop(sig: int) -> None:
        sent.append(sig)
        for rank in up:
            _signal(procs[rank], sig)

    while len(out) < len(procs):
        if stop_signal is not None and stop_when is not None and stop_when():
            send_stop(stop_signal)
            stop_signal = None
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except KeyboardInterrupt:
            if stop_signal is None:
                raise
            print(
                "xronos: stopping at the end of this step (Ctrl-C or SIGTERM again to abort)",
                file=sys.stderr,
            )
            send_stop(stop_signal)
            stop_signal = None
            continue
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in out and p.exitcode is not None:
                    # give a message that was sent just before exiting a moment to arrive
                    time.sleep(0.5)
                    if results.empty():
                        raise_died(devices, rank, p.exitcode)
            continue
        if kind == "up":
            up.add(rank)
            if sent:
                _signal(procs[rank], sent[0])
        elif kind == "event":
            if on_event is not None:
                on_event(rank, payload)
        elif kind == "ok":
            out[rank] = pickle.loads(payload)
        elif kind == "user":
            raise UserError(payload)
        else:
            heard = raise_root_cause(procs, results, devices, {rank}, on_event)
            first, _, tb = payload.partition("\n")
            if kind == "comm":
                grace = min(timeout_s / 2, SILENCE_GRACE_S)
                silent = silent_peer(procs, results, heard, grace, on_event)
                raise_root_cause(procs, results, devices, heard, on_event)
                if silent is not None:
                    why = f"stopped answering (no reply within the {timeout_s:g} s timeout)"
                    seen = f"device {devices[rank]!r} (rank {rank}): {first}\n{tb}"
                    raise DeviceLost(devices[silent], silent, why, seen)
            raise WorkerError(f"device {devices[rank]!r} (rank {rank}) failed: {first}", tb)
    return [out[r] for r in range(len(procs))]


def _signal(p: Any, sig: int) -> None:
    if p.is_alive() and p.pid is not None:
        os.kill(p.pid, sig)


def _stop_all(procs: list[Any], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # not SIGTERM: to a finetune worker that asks it to finish its step
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
