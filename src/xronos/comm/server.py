"""Imported first by the process that workers are forked from (``forkserver``,
:func:`xronos.comm.start.start_method`): it ignores SIGTERM. A SIGTERM to the whole process
group (``timeout``, a service manager's stop) would otherwise end it, and the launcher, which
hears its workers' exits through it, would take every worker for dead while they finish
their step. It ends when its launcher does. Workers take the default back as they start
(:mod:`xronos.comm.launch`). Importing this module is the whole effect."""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
