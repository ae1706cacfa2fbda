"""Named benchmark scenarios: a cluster, a model and a workload, fixed so runs compare."""

from __future__ import annotations

from dataclasses import dataclass

from xronos.errors import UserError


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    cluster: str
    """Cluster preset (see ``xronos.emulation``)."""
    model: str
    """Model preset or directory."""
    batch_size: int
    seq_len: int
    steps: int
    """Counted steps per strategy. The 2- and 3-device scenarios count 32: a shared host's
    speed can move by a fifth for one to three seconds at a time, and over 8 steps two such
    moments moved one strategy's median against another's by 7 % with the same plan; over
    16, two identical configurations in one run still measured up to 10 % apart
    (docs/benchmarks.md)."""
    warmup: int
    """Uncounted steps per strategy before them. ``ci-2dev`` and ``edge-3dev`` warm up for
    12: a calibrated tensor-parallel plan's balance is checked against its first steps
    after 10 of them, as ``xronos finetune`` does (:data:`xronos.bench.steps.BALANCE_HORIZON`),
    and moved before the counted steps where that pays; such a move lengthens the warm-up
    until it has been judged (:attr:`xronos.bench.steps.Run.warmup`)."""
    lora_rank: int = 0
    """0 = full fine-tuning."""
    description: str = ""


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            name="ci-2dev",
            cluster="ci-2dev",
            model="small",
            batch_size=4,
            seq_len=64,
            steps=32,
            warmup=12,
            description="2 devices on a 2-core host: 1 core at 100 %, 1 core at 40 % quota",
        ),
        Scenario(
            name="ci-2dev-mem",
            cluster="ci-2dev-mem",
            model="small",
            batch_size=4,
            seq_len=64,
            steps=16,
            warmup=2,
            description="ci-2dev with 740 MiB per device: neither holds the fine-tuning alone",
        ),
        Scenario(
            name="edge-3dev",
            cluster="edge-3dev",
            model="small",
            batch_size=6,
            seq_len=64,
            steps=32,
            warmup=12,
            description="3 devices at speeds 1 : 0.5 : 0.25",
        ),
        Scenario(
            name="edge-4dev",
            cluster="edge-4dev",
            model="small",
            batch_size=8,
            seq_len=256,
            steps=10,
            warmup=3,
            description="16-core host: 4/4/2/2 cores at mixed quotas, 1 Gbit/s and 100 Mbit/s",
        ),
        Scenario(
            name="smoke",
            cluster="ci-2dev",
            model="small",
            batch_size=4,
            seq_len=16,
            steps=3,
            warmup=1,
            description="seconds-long check of the bench machinery (tests)",
        ),
    )
}


def get_scenario(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise UserError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]
