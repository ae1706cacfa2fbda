"""``xronos join``: take a device that a running ``xronos finetune`` lost back into it.

The run's launcher notices the request within a second, stops the workers after the step
in flight with a checkpoint, profiles every device again and goes on from that checkpoint
with the device back in the plan (``device_joined`` in ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "join",
        help="take a device that a running fine-tune lost back into it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="the run directory of the running xronos finetune")
    p.add_argument("device", help="the device's name (see the run's devices.json, 'lost')")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from xronos.run.membership import request_join

    path = request_join(args.run_dir, args.device)
    print(f"asked the run to take {args.device!r} back ({path}); it joins after the step in flight")
    return 0
