"""Which device is the coordinator: the one started with the job's options.

Under torchrun every device runs ``xronos worker``; only the coordinator is given the
model, the data and the training options (the other devices hold no files of the job).
torchrun's c10d rendezvous assigns ranks in an order of its own, so before admission every
device says through the store whether it was given options. The coordinator checks every
other device's token (:mod:`~xronos.comm.auth`) and then becomes rank 0 of the process
group: the rank that serves the files, writes the run directory and reports. (What a
device says here is not secret and not trusted: a device that lies about it can at worst
stop the join, which anything that reaches the store can do anyway.)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import time

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


def torchrun_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT, as ``env://`` reaches it but without the
    prefix it adds under torchrun (``/worker/attempt_<restart count>``): agents whose
    workers were restarted for different reasons count restarts differently, and the
    devices of one round must meet under the same keys (:func:`agree_on_round`)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agent serves it
        return dist.TCPStore(host, port, world, False, timeout)
    return dist.TCPStore(host, port, world, rank == 0, timeout, multi_tenant=True)


def agree_on_round(
    store: dist.Store,
    rank: int,
    world: int,
    lead: bool,
    options: str,
    device: str,
    timeout_s: float,
) -> tuple[list[int], str]:
    """torchrun's ranks in Xronos's order (the coordinator first) and an id of this round
    that every device of it shares (collective through ``store``: every device calls it).

    The store may still hold an earlier round's keys (torchrun restarted the workers), so
    each device writes its role with a fresh nonce, then the digest of the nonces it read;
    the round is agreed when every device's digest is the same — which holds only once
    each has read every device's fresh nonce."""
    nonce = secrets.token_hex(8)
    store.set(f"role/{rank}", json.dumps({"nonce": nonce, "lead": lead, "options": options}))
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        read = [_read(store, f"role/{r}") for r in range(world)]
        roles = [v for v in read if isinstance(v, dict)]
        if len(roles) == world:
            mine = hashlib.sha256(json.dumps([v.get("nonce") for v in roles]).encode()).hexdigest()
            store.set(f"seen/{rank}", json.dumps(mine))
            if all(_read(store, f"seen/{r}") == mine for r in range(world)):
                return coordinator_order(roles), mine[:20]
        time.sleep(0.05)
    raise UserError(
        f"device '{device}': the {world} devices of this round did not all arrive within "
        f"{timeout_s:.0f} s; are they all started for the same job?"
    )


def _read(store: dist.Store, key: str) -> object:
    try:
        return json.loads(store.get(key)) if store.check([key]) else None
    except (ValueError, UnicodeDecodeError):
        return None
