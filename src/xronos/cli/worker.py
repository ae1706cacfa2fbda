"""``xronos worker``: one device of a real multi-machine run, started by ``torchrun``.

Only the coordinator holds the model, the data and the run directory; it is the one device
started with the finetune options. Every other device runs the same torchrun command with
no options at all::

    # the coordinator (the hub)
    torchrun --nnodes 3 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HUB_ADDRESS:29500 --rdzv-id home \\
        -m xronos worker --token-file TOKEN --model ./Qwen2.5-0.5B --data ./home.jsonl \\
        --out runs/home
    # every other device
    torchrun ... the same torchrun flags ... -m xronos worker --token-file TOKEN

``torchrun`` provides RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Before the gloo group
forms, every machine proves through torchrun's store that it holds the job's token
(``XRONOS_TOKEN`` or ``--token-file``; the token itself never crosses the network) and runs
the same Xronos and torch versions; a machine that does not is refused, and the others
stop after ``--join-timeout`` unless a machine with the token takes its place. Then the
coordinator becomes rank 0, gives every device the job, and serves each only the weight
slices it asks for (SHA-256 checked); the devices send it their checkpoint shards, so
nothing of the run is written anywhere else. Profiling, planning and training are those of
``xronos finetune``. ``--resume RUN_DIR`` on the coordinator continues a run. Name a
machine with ``XRONOS_DEVICE`` (default: host name + local rank, made unique). See
docs/deploy.md for what the token does and does not protect.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xronos.cli.finetune import add_config_flags
from xronos.comm.auth import join_torchrun_group
from xronos.comm.job_token import TOKEN_ENV, load_token
from xronos.errors import RunComplete, UserError, WorkerError
from xronos.runconfig import build_config, config_fields, load_toml


def register(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="one device of a multi-machine run (start it with torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file with the finetune options ([finetune] table)")
    skip = (
        "cluster",
        "emulate",
        "network",
        "bandwidth",
        "latency",
        "elastic",
        "disturb",
        "leave",
        "rejoin",
    )
    add_config_flags(p, skip=skip)
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file whose first line is the job's token (default: ${TOKEN_ENV}); only "
        "devices that prove they hold it join; the file must not be readable by every user",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        metavar="SECONDS",
        help="how long every device waits for all devices to prove the token (default: --timeout)",
    )
    p.set_defaults(run=run)


class _Direct:
    """Rank 0's event channel when there is no parent process: events go to the monitor."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def put(self, item: tuple[str, int, dict[str, Any]]) -> None:
        self.monitor.on_event(item[1], item[2])


def device_names(asked: list[tuple[str, bool]]) -> list[str]:
    """Every rank's device name, unique without configuration.

    ``asked`` is each rank's ``(name, explicit)``: ``XRONOS_DEVICE`` (explicit: kept as
    given, a duplicate is the user's to fix) or host name + local rank (every Raspberry Pi
    is called ``raspberrypi``: characters a device name cannot hold become ``-``, and a
    name several ranks share gets ``-2``, ``-3``, … on its later holders, in rank order).
    """
    out: list[str] = []
    for name, explicit in asked:
        if explicit:
            out.append(name)
            continue
        base = re.sub(r"[^A-Za-z0-9_-]", "-", name).strip("-")[:28] or "device"
        taken = {n for n in out} | {n for n, e in asked if e}
        candidate, k = base, 1
        while candidate in taken:
            k += 1
            candidate = f"{base}-{k}"
        out.append(candidate)
    return out


def _options(args: argparse.Namespace, flags: dict[str, Any]) -> tuple[bool, str]:
    """Whether this device was given the job's options, and their digest."""
    given = {k: v for k, v in flags.items() if v is not None}
    text = Path(args.config).read_text() if args.config and Path(args.config).is_file() else ""
    blob = json.dumps([given, args.config and text], sort_keys=True, default=str)
    return bool(given) or bool(args.config), hashlib.sha256(blob.encode()).hexdigest()


def _lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is gloo's word for a connection to another device that failed."""
    text = str(e)
    words = ("Connection reset", "Connection closed", "Timed out", "monitoredBarrier", "gloo")
    return any(w in text for w in words)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def run(args: argparse.Namespace) -> int:
    from xronos.checkpoint import latest_checkpoint, read_checkpoint_meta
    from xronos.comm.heap import keep_freed_memory
    from xronos.comm.launch import WorkerContext
    from xronos.comm.mappings import TPGroup
    from xronos.comm.stop import request as request_stop
    from xronos.emulation import ClusterSpec, DeviceSpec
    from xronos.run.coordinator import share_job
    from xronos.run.membership import (
        record_agent,
        restart_events,
        restarted_by_agent,
        torchrun_agent,
    )
    from xronos.run.monitor import RunMonitor
    from xronos.run.prepare import accuracy, prepare_run, write_config
    from xronos.run.worker import finetune_worker

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "xronos worker runs under torchrun (RANK/WORLD_SIZE are not set); "
            "on one machine use `xronos finetune`"
        )
    keep_freed_memory()
    flags = {f.name: getattr(args, f.name, None) for f in config_fields()}
    lead, options = _options(args, flags)
    local = build_config({}, {"timeout": flags.get("timeout")})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    agent = torchrun_agent()
    explicit = os.environ.get("XRONOS_DEVICE")
    mine = explicit or f"{socket.gethostname()}-{os.environ.get('LOCAL_RANK', '0')}"
    secret = load_token(args.token_file)
    join_timeout = args.join_timeout if args.join_timeout is not None else local.timeout
    if join_timeout <= 0:
        raise UserError(f"--join-timeout must be positive (got {join_timeout:g})")
    rank = join_torchrun_group(
        rank, world, mine, secret, local.timeout, join_timeout, lead=lead, options=options
    )
    # torchrun passes Ctrl-C on to its worker as SIGTERM: stop after the step in flight
    # and checkpoint (every device agrees at the step's end), as `xronos finetune` does
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (mine, explicit is not None, threads))
        names = device_names([(n, e) for n, e, _ in gathered])
        me = names[rank]
        cores = [c for _, _, c in gathered]
        devices = tuple(DeviceSpec(name=n, cores=c) for n, c in zip(names, cores, strict=True))
        cluster = ClusterSpec(name="torchrun", devices=devices)

        def make() -> Any:  # on the coordinator: the finetune options, as `finetune` reads them
            nonlocal restarted
            asked = flags | {"emulate": False}  # the machines are real
            out = build_config(load_toml(args.config) if args.config else {}, flags).out
            # torchrun restarted the job (a failure counts; a device that arrives does not)
            restarted = restarted or bool(out and restarted_by_agent(Path(out), agent))
            if restarted and not asked.get("resume") and out and latest_checkpoint(out):
                asked["resume"] = out  # continue where it was
            try:
                prep = prepare_run(asked, args.config, cluster, restart=restarted)
            except RunComplete as e:
                if not restarted:  # the user asked to continue a run that has ended
                    raise UserError(str(e)) from None
                raise RunComplete(
                    f"the run in {asked['resume']} has trained every step; torchrun started the "
                    "workers again as it ended (a device came or went): nothing to do"
                ) from None
            write_config(prep)
            record_agent(prep.run_dir, agent)
            for line in prep.notes:
                print(line)
            return prep

        try:
            shared = share_job(rank, world, make, local.timeout)
        except RunComplete as e:
            print(f"xronos: device '{me}': {e}")
            return 0
        ctx = WorkerContext(
            rank, world, me, TPGroup.from_default(), shared.cfg.timeout, tuple(names)
        )
        monitor = None
        if shared.prep is not None:
            prep = shared.prep
            print(
                f"coordinating {world} devices ({', '.join(names)}); run directory {prep.run_dir}"
            )
            monitor = RunMonitor(
                prep.run_dir,
                prep.job.steps,
                lambda g: accuracy(prep.tokenizer, g, prep.eval_refs),
            )
            ctx.channel = _Direct(monitor)
            if restarted and prep.job.resume:  # torchrun restarted it, maybe on other devices
                step = int(read_checkpoint_meta(prep.job.resume)["step"])
                restart_events(monitor, prep.run_dir, list(names), step)
        try:
            result = finetune_worker(ctx, shared.job)
        except (RuntimeError, dist.DistError) as e:  # a peer's connection failed mid-run
            if isinstance(e, WorkerError) or not _lost_peer(e):
                raise
            raise WorkerError(
                f"device '{me}': lost a device ({_first_line(e)}); torchrun restarts the "
                "job when --max-restarts allows, and the coordinator resumes from its "
                "newest checkpoint",
                traceback.format_exc(),
            ) from None
        said = shared.close()
        if said:
            print(f"xronos: device '{me}': {said}")
        if monitor is not None:
            print(monitor.finish(result.step))
        # Tear down together: a rank that destroys its process group while another still
        # writes the run's outputs can abort at exit inside gloo's transport threads. (A
        # device that auto left out has already gone: then the trainers do not wait for it.)
        if len(result.members) == world:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
