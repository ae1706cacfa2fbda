"""A run whose files only the coordinator holds (``xronos worker`` under torchrun).

    coordinator (rank 0)                        every other device
    prepare: model config, tokenizer, data
    broadcast the job ──────────────────────►   the job: config, plan inputs, token ids
    RelayServer (thread) ◄── slice requests ──  RelayClient: weights, checkpoint slices
    writes the run directory ◄── shards ──────  checkpoint shards (sent, never written)
    waits for every "bye"    ◄── bye ─────────  done

The job carries the model's configuration and the tokenized examples (token ids only: no
text, no files); weights and checkpoints travel as the slices each device asks for.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from xronos.comm.groups import new_group
from xronos.comm.relay import RelayClient, install
from xronos.errors import RunComplete, UserError
from xronos.run.moves import move_prefix
from xronos.run.prepare import Prepared
from xronos.run.relay_server import RelayServer
from xronos.run.worker import FinetuneJob
from xronos.runconfig import RunConfig

RELAY_IDLE = datetime.timedelta(days=30)
"""How long the coordinator's server may wait between two requests (training can run for
days without one); every device's own wait for an answer is bounded by ``--timeout``."""


@dataclass
class Shared:
    """What every device runs, and its end of the relay."""

    job: FinetuneJob
    cfg: RunConfig
    prep: Prepared | None
    """The coordinator's full preparation (tokenizer, run directory); None elsewhere."""
    server: RelayServer | None = None
    client: RelayClient | None = None

    def close(self) -> str | None:
        """End the relay: devices say they are done, the coordinator waits for them
        (bounded). Returns a line for this device's console, or None."""
        if self.client is not None:
            self.client.bye()
            install(None)
            mb = self.client.bytes_received / 1e6
            return f"received {mb:.1f} MB of model and checkpoint slices from the coordinator"
        if self.server is not None and not self.server.close(self.cfg.timeout):
            return "not every device said it was done; stopping anyway"
        return None


def share_job(rank: int, world: int, make: Callable[[], Prepared], timeout_s: float) -> Shared:
    """Prepare the job on the coordinator and give it to every device; start the relay.
    Collective over the default group. A failure on the coordinator stops every device
    with its line (no device waits for a job that will not come); a run it finds complete
    (``RunComplete``) ends every device with it."""
    relay = new_group(timeout_s=RELAY_IDLE.total_seconds())
    sent: list[object] = [None, None]
    prep: Prepared | None = None
    if rank == 0:
        try:
            prep = make()
            sent = [prep.job, prep.cfg]
        except UserError as e:
            sent = [None, e if isinstance(e, RunComplete) else str(e)]
            dist.broadcast_object_list(sent, src=0)
            raise
    dist.broadcast_object_list(sent, src=0)
    job, cfg = sent
    if isinstance(cfg, RunComplete):
        raise cfg
    if not isinstance(job, FinetuneJob) or not isinstance(cfg, RunConfig):
        raise UserError(f"the coordinator stopped: {cfg}")
    job = replace(job, session=replace(job.session, anchor=0))
    shared = Shared(job, cfg, prep)
    if rank == 0:
        allowed = {str(p) for p in (job.session.source.model_dir, job.resume) if p}
        pid = os.getpid()  # live re-balancing's checkpoints, in memory or (caps) on disk
        moves = (move_prefix(pid), move_prefix(pid, on_disk=True))
        clients = set(range(1, world))
        shared.server = RelayServer(relay, clients, allowed, timeout_s, moves).start()
    else:
        shared.client = RelayClient(relay, timeout_s)
        install(shared.client)
    return shared
