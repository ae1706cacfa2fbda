"""Whether every strategy of a bench computed what ``single`` computed: same batches, same
mathematics, so the same loss at every step up to the order of additions and the
payloads' rounding. A faster step that trains something else is a fault, not a win."""

from __future__ import annotations

import math
from typing import Any

LOSS_RTOL = 2e-4
"""How far a strategy's loss may stray from ``single``'s at any step, relative, before the
bench flags it. Every strategy runs the same mathematics on the same batches, so only the
order of additions and the payloads' rounding part them: over 290 strategy runs of 4–60
steps (``small`` and smaller, full fine-tuning and LoRA, bf16 and fp32 payloads, pipelines
included) the largest gap was 6.8e-5 (4.6e-5 past four steps). A trial step that never
updated the embedding strayed 6.8e-4 within 28 steps. Over long runs bf16 payloads drift
further; ``--comm-dtype fp32`` tells the two apart."""


def loss_agreement(strategies: dict[str, dict[str, Any]]) -> None:
    """Gives each of ``bench.json``'s strategies its largest relative gap to ``single``'s
    loss over the steps both ran (``loss_gap_vs_single``) and whether that is within
    :data:`LOSS_RTOL` (``loss_matches_single``); both None where ``single`` did not run or
    no step was shared."""
    ref = strategies.get("single", {}).get("losses") or []
    for entry in strategies.values():
        losses = entry.get("losses")
        if losses is None:
            continue
        gaps = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=False) if b]
        gap = None
        if gaps:  # a NaN or infinite loss never agrees
            gap = max(gaps) if all(math.isfinite(g) for g in gaps) else math.inf
        entry["loss_gap_vs_single"] = gap
        entry["loss_matches_single"] = None if gap is None else gap <= LOSS_RTOL


def disagreement_note(name: str, entry: dict[str, Any]) -> str | None:
    """The line under the bench table for a strategy whose loss left ``single``'s; None
    for one that agrees or could not be compared."""
    if entry.get("loss_matches_single") is not False:
        return None
    gap = entry.get("loss_gap_vs_single")
    by = "a non-finite loss" if gap is None or not math.isfinite(gap) else f"{gap:.1e}"
    return (
        f"{name}: loss left single's by {by} (relative; reordered sums and bf16 payloads "
        f"stay under {LOSS_RTOL:.0e}): it did not train the same model; rerun with "
        "--comm-dtype fp32 to tell drift from a fault"
    )
