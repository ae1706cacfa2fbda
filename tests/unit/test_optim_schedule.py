"""The learning-rate schedule after the warm-up matches Hugging Face's schedules of the same
name (linear is the Trainer's default), so a run continues to learn without the late
divergence a constant AdamW rate can cause."""

from __future__ import annotations

import pytest
import torch

from xronos.errors import UserError
from xronos.runconfig import RunConfig
from xronos.train.optim import OptimConfig, lr_factor

transformers = pytest.importorskip("transformers")


def _hf_factors(kind: str, warmup: int, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    make = {
        "linear": transformers.get_linear_schedule_with_warmup,
        "cosine": transformers.get_cosine_schedule_with_warmup,
    }[kind]
    sched = make(opt, num_warmup_steps=warmup, num_training_steps=total)
    return [float(f(s)) for s in range(total) for f in sched.lr_lambdas]


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_decay_after_warmup_equals_hugging_faces(kind: str) -> None:
    warmup, total = 3, 20
    opt = OptimConfig(lr=1.0, warmup_steps=warmup, schedule=kind, total_steps=total)
    ours = [lr_factor(opt, s) for s in range(total)]
    theirs = _hf_factors(kind, warmup, total)
    # Warm-up differs on purpose (ours starts at 1/warmup, not 0: the first step trains);
    # from the warm-up's end on both are the same closed form, equal to rounding.
    assert ours[warmup:] == pytest.approx(theirs[warmup:], abs=1e-12)
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert ours[-1] > 0  # the last step still trains


def test_constant_stays_at_the_peak_and_no_total_means_constant() -> None:
    assert [lr_factor(OptimConfig(warmup_steps=2, schedule="constant", total_steps=9), s)
            for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]  # fmt: skip
    assert lr_factor(OptimConfig(schedule="linear", total_steps=0), 7) == 1.0


def test_an_unknown_schedule_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="--lr-schedule 'step': unknown; use one of linear"):
        RunConfig(lr_schedule="step").validate()
