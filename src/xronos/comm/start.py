"""How the local launcher starts its workers."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any


def start_method(module: str, forked: bool) -> Any:
    """The multiprocessing context for workers running a function of ``module``.

    ``forked`` (where the platform can): forked from a server process that has imported
    torch (:mod:`xronos.comm.warm`) and ``module`` once, for all the launches of this
    process (``forkserver``) — a worker then starts in a fraction of a second instead of
    importing torch anew, which takes seconds on a small CPU. Otherwise a fresh
    interpreter each (``spawn``). Either way nothing is inherited but what is pickled: a
    forked worker takes the launcher's environment as it is at the launch.
    """
    if forked and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # used once per process; the server outlives a SIGTERM to the process group
        ctx.set_forkserver_preload(["xronos.comm.server", "xronos.comm.warm", module])
        return ctx
    return mp.get_context("spawn")
