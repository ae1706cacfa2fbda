"""``xronos worker``: one device of a real multi-machine run, started by ``torchrun``.

Every machine runs the same command with the same options and data files::

    torchrun --nnodes 3 --nproc-per-node 1 --node-rank K \\
        --rdzv-backend c10d --rdzv-endpoint HUB_ADDRESS:29500 \\
        -m xronos worker --model ./Qwen2.5-0.5B --data ./home.jsonl --out runs/home

``torchrun`` provides RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Before the gloo group
forms, every machine proves through torchrun's store that it holds the job's token
(``XRONOS_TOKEN`` or ``--token-file``; the token itself never crosses the network) and runs
the coordinator's Xronos and torch versions; a machine that does not is refused, and the
others stop after ``--join-timeout`` unless a machine with the token takes its place. Then
Xronos profiles each machine, plans, and trains exactly as ``xronos finetune`` does on
emulated devices. Rank 0 (the coordinator) prints the progress and writes the run
directory; name a machine with ``XRONOS_DEVICE`` (default: host name + local rank).
See docs/deploy.md for what the token does and does not protect.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from xronos.cli.finetune import add_config_flags
from xronos.comm.auth import join_torchrun_group
from xronos.comm.job_token import TOKEN_ENV, load_token
from xronos.errors import UserError
from xronos.runconfig import build_config, config_fields, load_toml


def register(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="one device of a multi-machine run (start it with torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file with the finetune options ([finetune] table)")
    skip = ("cluster", "emulate", "resume", "network", "bandwidth", "latency", "elastic")
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


def run(args: argparse.Namespace) -> int:
    from xronos.comm.launch import WorkerContext
    from xronos.comm.mappings import TPGroup
    from xronos.emulation import ClusterSpec, DeviceSpec
    from xronos.run.monitor import RunMonitor
    from xronos.run.prepare import accuracy, prepare, write_config
    from xronos.run.worker import finetune_worker

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "xronos worker runs under torchrun (RANK/WORLD_SIZE are not set); "
            "on one machine use `xronos finetune`"
        )
    flags = {f.name: getattr(args, f.name, None) for f in config_fields()}
    cfg = build_config(load_toml(args.config) if args.config else {}, flags)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    explicit = os.environ.get("XRONOS_DEVICE")
    mine = explicit or f"{socket.gethostname()}-{os.environ.get('LOCAL_RANK', '0')}"
    secret = load_token(args.token_file)
    join_timeout = args.join_timeout if args.join_timeout is not None else cfg.timeout
    if join_timeout <= 0:
        raise UserError(f"--join-timeout must be positive (got {join_timeout:g})")
    join_torchrun_group(rank, world, mine, secret, cfg.timeout, join_timeout)
    try:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (mine, explicit is not None))
        names = device_names(gathered)
        me = names[rank]
        threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)
        cluster = ClusterSpec(
            name="torchrun", devices=tuple(DeviceSpec(name=n, cores=threads) for n in names)
        )
        prep = prepare(replace(cfg, emulate=False), cluster=cluster)
        ctx = WorkerContext(rank, world, me, TPGroup.from_default(), cfg.timeout, tuple(names))
        monitor = None
        if rank == 0:
            write_config(prep)
            monitor = RunMonitor(
                prep.run_dir,
                prep.job.steps,
                lambda g: accuracy(prep.tokenizer, g, prep.eval_refs),
            )
            ctx.channel = _Direct(monitor)
        result = finetune_worker(ctx, prep.job)
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
