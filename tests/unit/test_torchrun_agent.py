"""How the coordinator tells a restart of its torchrun job from a new job: by the agent (the
worker's parent process) recorded in the run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from xronos.run.membership import record_agent, restarted_by_agent, torchrun_agent

PRINT_AGENT = "from xronos.run.membership import torchrun_agent; print(torchrun_agent())"


def _agent_of_a_child() -> str:
    """torchrun_agent() in a worker started by this process (this process: its agent)."""
    out = subprocess.run([sys.executable, "-c", PRINT_AGENT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_workers_of_one_agent_continue_its_run_and_another_agent_starts_afresh(
    tmp_path: Path,
) -> None:
    first = _agent_of_a_child()
    assert not restarted_by_agent(tmp_path, first)  # nothing recorded yet
    record_agent(tmp_path, first)
    # a worker the same agent starts again (whatever made it restart) is the same job
    again = _agent_of_a_child()
    assert again == first and restarted_by_agent(tmp_path, again)
    # a worker of another agent (another torchrun command) is not: here, this process's
    # own identity names its parent, not this process
    assert torchrun_agent() != first
    assert not restarted_by_agent(tmp_path, torchrun_agent())
