"""What a capped device may give the model: its cap less what its process already holds."""

from __future__ import annotations

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.profiler.measure import Shape
from xronos.run.sessions import Profiles, ProfileSource

CAP = 4 << 30


def _usable(ctx: WorkerContext, caps: tuple[int | None, ...]) -> tuple[int, int]:
    profiles = [
        DeviceProfile(
            name=f"rank{i}",
            segments={s: CostCurve(0.0, 1e-3) for s in ("attn", "mlp", "vocab")},
            replicated_s=0.0,
            memory_bytes=CAP,
        )
        for i in range(ctx.world_size)
    ]
    shape = Shape(cfg=product.CFG, batch_size=2, seq_len=16, mlp_chunk=8, vocab_chunk=8)
    source = ProfileSource(memory_caps=caps, keys=("a", "b"), cached=tuple(profiles))
    got = Profiles(ctx, shape, source).usable()
    return got[0].memory_bytes, got[1].memory_bytes


def test_a_capped_device_loses_its_process_runtime_and_an_uncapped_one_nothing() -> None:
    capped, free = run_world(_usable, 2, (CAP, None))[0]
    # a Python process with torch loaded holds well over 50 MiB and, here, far below 4 GiB
    assert 0 < capped < CAP - (50 << 20)
    assert free == CAP  # no cap: the profile is kept as measured
    # no device capped: nothing is measured or changed
    assert run_world(_usable, 2, (None, None))[0] == (CAP, CAP)
