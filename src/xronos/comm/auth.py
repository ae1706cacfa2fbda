"""Admission to a job: every device proves it holds the job's token before the gloo group
forms, through the rendezvous store, without the token crossing the network.

The store (torchrun's, reached through MASTER_ADDR:MASTER_PORT) has no access control:
anything that can reach its port can read and write every key. So every message is either
harmless to read or bound by an HMAC-SHA256 keyed with the token to fresh nonces of both
sides; a captured answer is worth nothing in another exchange.

    worker r                                coordinator (the device given the options)
    hello/r     {n_r, versions}        ──►
                                       ◄──  challenge/r  {echo n_r, n_0, versions_0,
                                                          H("coordinator", n_0, n_r, r, versions_0)}
    (checks the coordinator's MAC, then the versions)
    proof/r     {echo n_0,             ──►
                 H("worker", n_0, n_r, r, versions_r)}
                                            (checks the worker's MAC and versions)
                                       ◄──  verdict/r  refused | waiting | admitted
                                                       (admitted: H("admitted", n_0, n_r, r),
                                                        written once every rank is in)

n_0 is fresh per worker and per hello, n_r fresh per worker start; stale keys of an earlier
attempt never match a live exchange and are ignored. A refused device can come back (a new
hello at its rank) until the join timeout. Without a token both sides use the empty key:
the exchange then only checks versions, and every device says that anyone can join.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import torch.distributed as dist

from xronos.comm.groups import init_world
from xronos.comm.job_token import TOKEN_ENV, no_token_warning
from xronos.comm.roles import agree_on_round, torchrun_store
from xronos.errors import UserError

_PROTOCOL = "xronos-join-v1"
_HOW = f"give the job's token via {TOKEN_ENV} or --token-file"


@dataclass(frozen=True)
class Identity:
    """What every device must share with the coordinator to join."""

    xronos: str
    torch: str

    def mismatch(self, other: Identity) -> str | None:
        """``None`` when compatible, else the first difference as ``name mine vs theirs``.
        torch is compared without its local label (``2.5.1+cpu`` on x86 and ``2.5.1`` on
        ARM64 are the same release, built for different machines)."""
        if self.xronos != other.xronos:
            return f"Xronos {self.xronos} (this device) vs {other.xronos} (the coordinator)"
        if self.torch.split("+")[0] != other.torch.split("+")[0]:
            return f"torch {self.torch} (this device) vs {other.torch} (the coordinator)"
        return None


def local_identity() -> Identity:
    import torch

    from xronos import __version__

    return Identity(xronos=__version__, torch=str(torch.__version__))


def mac(secret: bytes, label: str, *fields: object) -> str:
    """HMAC-SHA256 of length-prefixed fields (no two field lists encode alike)."""
    h = hmac.new(secret, digestmod=sha256)
    for part in (_PROTOCOL, label, *fields):
        data = str(part).encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.hexdigest()


def _verify(secret: bytes, got: object, label: str, *fields: object) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got, mac(secret, label, *fields))


@dataclass
class Join:
    """One side of the admission exchange (a rank, its store, its token, its deadline)."""

    store: dist.Store
    rank: int
    world_size: int
    device: str
    secret: bytes | None
    timeout_s: float
    identity: Identity = field(default_factory=local_identity)
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))
    coordinator: int = 0
    """The rank that checks every other (the device given the job's options)."""
    poll_s: float = 0.05

    @property
    def key(self) -> bytes:
        return self.secret or b""

    def read(self, name: str) -> dict[str, Any] | None:
        """The JSON object under ``name``; None when absent or not an object."""
        try:
            if not self.store.check([name]):
                return None
            raw = self.store.get(name)
        except RuntimeError as e:  # torch's DistError and its store errors
            raise self._lost(e) from None
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def write(self, name: str, value: dict[str, Any]) -> None:
        try:
            self.store.set(name, json.dumps(value))
        except RuntimeError as e:
            raise self._lost(e) from None

    def _lost(self, e: BaseException) -> UserError:
        return UserError(
            f"device '{self.device}': lost the rendezvous store ({_first_line(e)}); "
            "the torchrun agent that hosts it has probably stopped"
        )

    def wait_for(self, name: str, fresh: Callable[[dict[str, Any]], bool], until: float) -> Any:
        while time.monotonic() < until:
            value = self.read(name)
            if value is not None and fresh(value):
                return value
            time.sleep(self.poll_s)
        return None


def admit(join: Join) -> None:
    """Return once every rank has proven the token and its versions; raise ``UserError``
    with one line (naming this device) otherwise."""
    if join.world_size <= 1:
        return
    if join.rank == join.coordinator:
        _coordinate(join)
    else:
        _join(join)


def _join(j: Join) -> None:
    until = time.monotonic() + j.timeout_s
    me, mine = j.rank, j.identity
    n_r = secrets.token_hex(16)
    hello = {"nonce": n_r, "device": j.device, "token": j.secret is not None}
    j.write(f"hello/{me}", hello | {"xronos": mine.xronos, "torch": mine.torch})
    ch = j.wait_for(f"challenge/{me}", lambda v: v.get("echo") == n_r, until)
    if ch is None:
        raise UserError(
            f"device '{j.device}': the coordinator did not answer within "
            f"{j.timeout_s:.0f} s; is it running, and are both started for the same job?"
        )
    n_0, theirs = str(ch.get("nonce")), Identity(str(ch.get("xronos")), str(ch.get("torch")))
    trusted = _verify(j.key, ch.get("mac"), "coordinator", n_0, n_r, me, *_fields(theirs))
    if trusted and (diff := mine.mismatch(theirs)):
        raise UserError(
            f"device '{j.device}': refused to join: {diff}; install the same versions on "
            "every device"
        )
    proof = mac(j.key, "worker", n_0, n_r, me, *_fields(mine))
    j.write(f"proof/{me}", {"echo": n_0, "mac": proof})
    verdict = j.wait_for(
        f"verdict/{me}",
        lambda v: v.get("echo") == n_r and v.get("state") in ("refused", "admitted"),
        until,
    )
    if verdict is None:
        status = j.read(f"verdict/{me}") or {}
        why = status.get("reason") if status.get("echo") == n_r else None
        raise UserError(
            f"device '{j.device}': not every device joined within {j.timeout_s:.0f} s"
            f"{f' ({why})' if why else ''}; stopping"
        )
    admitted = verdict.get("state") == "admitted"
    if admitted and trusted and _verify(j.key, verdict.get("mac"), "admitted", n_0, n_r, me):
        return
    if trusted or admitted:  # a verdict the token does not back: someone else wrote it
        raise UserError(
            f"device '{j.device}': the coordinator's answers do not match this device's "
            "token; not joining it (is another program writing to the rendezvous store?)"
        )
    if j.secret is not None and ch.get("token") is False:
        raise UserError(
            f"device '{j.device}': the coordinator has no token but this device has one; "
            "give every device the same token"
        )
    raise UserError(f"device '{j.device}': the coordinator refused this device's token; {_HOW}")


def _fields(identity: Identity) -> tuple[str, str]:
    return identity.xronos, identity.torch


def _coordinate(j: Join) -> None:
    until = time.monotonic() + j.timeout_s
    peers = {r: _Peer() for r in range(j.world_size) if r != j.coordinator}
    while time.monotonic() < until:
        for r, peer in peers.items():
            _step(j, r, peer, until)
        pending = [r for r, p in peers.items() if p.state != "accepted"]
        if not pending:
            for r, peer in peers.items():
                admitted = mac(j.key, "admitted", peer.n_0, peer.nonce, r)
                j.write(f"verdict/{r}", {"echo": peer.nonce, "state": "admitted", "mac": admitted})
            return
        for r, peer in peers.items():
            if peer.state == "accepted" and peer.told != pending:
                peer.told = pending
                waiting = ", ".join(_named(r, peers[r]) for r in pending)
                reason = f"the coordinator admitted it and is waiting for {waiting}"
                j.write(f"verdict/{r}", {"echo": peer.nonce, "state": "waiting", "reason": reason})
        time.sleep(j.poll_s)
    missing = [
        f"rank {r}{f' ({p.device!r})' if p.device else ''} "
        + (p.reason or "never proved it holds the token")
        for r, p in peers.items()
        if p.state != "accepted"
    ]
    raise UserError(
        f"device '{j.device}': not every device joined within {j.timeout_s:.0f} s: "
        f"{'; '.join(missing)}; stopping"
    )


def _named(r: int, peer: _Peer) -> str:
    return f"rank {r} ({peer.device!r})" if peer.device else f"rank {r}"


@dataclass
class _Peer:
    """What the coordinator knows of one rank's latest attempt."""

    nonce: str = ""
    n_0: str = ""
    device: str = ""
    identity: Identity | None = None
    state: str = "absent"  # absent | challenged | accepted | refused
    reason: str = ""
    told: list[int] = field(default_factory=list)


def _step(j: Join, r: int, peer: _Peer, until: float) -> None:
    """Advance rank ``r``'s exchange by what the store holds now."""
    hello = j.read(f"hello/{r}")
    if hello is not None and isinstance(hello.get("nonce"), str) and hello["nonce"] != peer.nonce:
        _challenge(j, r, peer, hello)
        diff = peer.identity.mismatch(j.identity) if peer.identity else None
        if diff is not None:
            _refuse(j, r, peer, f"was refused: it runs {_swap(diff)}", until)
        return
    if peer.state != "challenged" or peer.identity is None:
        return
    proof = j.read(f"proof/{r}")
    if proof is None or proof.get("echo") != peer.n_0:
        return
    fields = (peer.n_0, peer.nonce, r, *_fields(peer.identity))
    if _verify(j.key, proof.get("mac"), "worker", *fields):
        peer.state, peer.told = "accepted", []
    else:
        _refuse(j, r, peer, "was refused: its token does not match the coordinator's", until)


def _challenge(j: Join, r: int, peer: _Peer, hello: dict[str, Any]) -> None:
    peer.nonce, peer.n_0 = hello["nonce"], secrets.token_hex(16)
    peer.device = str(hello.get("device", ""))[:64]
    peer.identity = Identity(str(hello.get("xronos")), str(hello.get("torch")))
    peer.state, peer.reason = "challenged", ""
    ours = j.identity
    j.write(
        f"challenge/{r}",
        {
            "echo": peer.nonce,
            "nonce": peer.n_0,
            "xronos": ours.xronos,
            "torch": ours.torch,
            "token": j.secret is not None,
            "mac": mac(j.key, "coordinator", peer.n_0, peer.nonce, r, *_fields(ours)),
        },
    )


def _refuse(j: Join, r: int, peer: _Peer, reason: str, until: float) -> None:
    peer.state, peer.reason = "refused", reason
    j.write(f"verdict/{r}", {"echo": peer.nonce, "state": "refused", "reason": reason})
    left = max(0.0, until - time.monotonic())
    j.log(
        f"xronos: device at rank {r} ({peer.device!r}) {reason}; waiting up to "
        f"{left:.0f} s more for a device with the job's token"
    )


def _swap(diff: str) -> str:
    """A worker-side mismatch line as the coordinator says it."""
    return diff.replace("(this device)", "(that device)").replace(
        "(the coordinator)", "(this coordinator)"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def join_torchrun_group(
    rank: int,
    world_size: int,
    device: str,
    secret: bytes | None,
    timeout_s: float,
    join_timeout_s: float,
    lead: bool = False,
    options: str = "",
) -> int:
    """Reach the store torchrun names in MASTER_ADDR/MASTER_PORT (as ``env://`` does), agree
    with the other devices on this round and its coordinator (``lead``: this device was
    given the job's options, whose digest is ``options``; :mod:`~xronos.comm.roles`), admit
    every device through the store, then form the default gloo group on it, the coordinator
    first. Returns this device's rank in that group."""
    import datetime

    endpoint = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if secret is None and world_size > 1:
        print(no_token_warning(endpoint), file=sys.stderr)
    timeout = datetime.timedelta(seconds=timeout_s)
    joining = datetime.timedelta(seconds=join_timeout_s)
    try:
        store = torchrun_store(rank, world_size, joining)
    except (RuntimeError, ValueError) as e:
        raise UserError(
            f"device '{device}': cannot reach the rendezvous store at {endpoint} ({_first_line(e)})"
        ) from None
    store.set_timeout(timeout)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    order, round_id = agree_on_round(
        dist.PrefixStore(f"xronos/roles/{run}", store),
        rank,
        world_size,
        lead,
        options,
        device,
        join_timeout_s,
    )
    joining_store = dist.PrefixStore(f"xronos/join/{round_id}", store)
    admit(
        Join(joining_store, rank, world_size, device, secret, join_timeout_s, coordinator=order[0])
    )
    ours = order.index(rank)
    try:
        init_world(dist.PrefixStore(f"xronos/pg/{round_id}", store), ours, world_size, timeout_s)
    except RuntimeError as e:  # gloo could not connect the devices' pairs
        raise UserError(
            f"device '{device}': admitted, but could not connect to the other devices "
            f"({_first_line(e)[:160]}); set GLOO_SOCKET_IFNAME to the network interface the "
            "devices share (e.g. eth0 or wg0) and check that each host name resolves to "
            "that interface's address, not 127.0.0.1"
        ) from None
    return ours
