"""Reshardable, atomic training checkpoints (safetensors + JSON, never pickle).

A checkpoint written by N ranks under one Plan loads on M ranks under another: every
rank saves its slices with their coordinates in the full tensor, and every loading rank
assembles its new slices from the overlapping parts (see :mod:`.layout`).

How a training loop uses it (every call is collective: all ranks of the group call it)::

    model = build_model(cfg, plan, group, model_dir=..., seed=seed, lora=lora)
    optimizer = torch.optim.AdamW(...)
    step = 0
    ckpt = latest_checkpoint(run_dir)            # None: start from scratch
    if ckpt is not None:
        loaded = load_checkpoint(ckpt, model=model, optimizer=optimizer, cfg=cfg,
                                 plan=plan, group=group)
        step = loaded.step
        batcher.load_state_dict(loaded.extra["data"])
    while step < steps:
        ...; step += 1
        if step % save_every == 0 or step == steps:
            save_checkpoint(checkpoint_path(run_dir, step), model=model, optimizer=optimizer,
                            step=step, cfg=cfg, plan=plan, group=group, extra=extra)

The ``extra`` dict (JSON) that the loop passes, read back by resume and export:

* ``extra["model"] = {"source": <--model as given>, "dir": <absolute HF directory, GGUF
  file or None>, "preset": <preset name or None>, "seed": <build_model seed>}`` -- export rebuilds
  the frozen base of a LoRA run from ``dir``, else from the preset ``seed``;
* ``extra["data"] = batcher.state_dict()`` -- the data position;
* anything else the loop wants back (optimizer settings, run config).

The LoRA settings, model config, Plan, step, AdamW state and RNG states are recorded by
the checkpoint itself.
"""

from xronos.checkpoint.load import (
    Loaded,
    checkpoint_path,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_meta,
)
from xronos.checkpoint.save import save_checkpoint

__all__ = [
    "Loaded",
    "checkpoint_path",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_checkpoint_meta",
    "save_checkpoint",
]
