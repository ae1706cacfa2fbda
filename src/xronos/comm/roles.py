"""Which device is the coordinator: the one started with the job's options.

Under torchrun every device runs ``xronos worker``; only the coordinator is given the
model, the data and the training options (the other devices hold no files of the job).
torchrun's c10d rendezvous assigns ranks in an order of its own, so after admission every
device says through the store whether it was given options, and Xronos numbers the
devices with the coordinator first: it becomes rank 0 of the process group, the rank that
serves the files, writes the run directory and reports.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from xronos.errors import UserError


def coordinator_order(roles: list[dict[str, object]]) -> list[int]:
    """torchrun ranks in Xronos's order: the coordinator first, the others as they came.

    ``roles[r]`` is rank ``r``'s ``{"lead": given options?, "options": their digest}``.
    No device with options: torchrun's rank 0 coordinates with the defaults. Several with
    the same options (every device started alike): the first of them. Several with
    different options: an error, since no one can tell which the user meant."""
    leads = [r for r, v in enumerate(roles) if v.get("lead")]
    if len({str(roles[r].get("options")) for r in leads}) > 1:
        raise UserError(
            f"devices at ranks {leads} were each started with different finetune options; "
            "give --model, --data and the other options to the coordinator alone and start "
            "the other devices with none"
        )
    first = leads[0] if leads else 0
    return [first] + [r for r in range(len(roles)) if r != first]


def exchange_roles(store: dist.Store, rank: int, world: int, lead: bool, options: str) -> int:
    """This device's Xronos rank (collective through ``store``: every device calls it)."""
    store.set(f"role/{rank}", json.dumps({"lead": lead, "options": options}))
    roles = [json.loads(store.get(f"role/{r}")) for r in range(world)]
    return coordinator_order(roles).index(rank)
