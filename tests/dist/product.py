"""The product's own fine-tuning worker, set up for exactness tests: a job on random
batches with a given plan, run on gloo ranks or as the single-device oracle."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest

from tests.dist.world import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.metrics import analyze_pipeline_step, is_pipeline
from xronos.metrics.records import StepRecord
from xronos.model.lora import LoRAConfig
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.profiler.measure import Shape
from xronos.run.opening import SessionSpec
from xronos.run.sessions import ProfileSource
from xronos.run.worker import FinetuneJob, WorkerResult, finetune_worker
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource

CFG = ModelConfig(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
)
"""The exactness tests' model: 2 layers, 4 query heads in 2 KV groups, tied embeddings."""


def four_layers(tied: bool) -> ModelConfig:
    """:data:`CFG` with 4 layers (pipelines need layers to split), tied or not."""
    return dataclasses.replace(CFG, num_layers=4, tie_word_embeddings=tied)


def job(
    cfg: ModelConfig,
    *,
    lora: LoRAConfig | None,
    steps: int,
    plan: Plan | None = None,
    pipeline: PipelinePlan | None = None,
    hybrid: HybridPlan | None = None,
    strategy: Strategy = Strategy.XRONOS,
    batch_size: int = 2,
    keep_records: bool = False,
) -> FinetuneJob:
    """``steps`` steps of batch ``batch_size`` × 16 tokens, 2 accumulated micro-batches, the
    same random step every time (a memorisation task whose loss must fall)."""
    source = ModelSource(cfg=cfg, seed=5, lora=lora)
    shape = Shape(cfg=cfg, batch_size=batch_size, seq_len=16, mlp_chunk=8, vocab_chunk=8)
    return FinetuneJob(
        session=SessionSpec(
            source=source,
            strategy=strategy,
            optim=OptimConfig(lr=1e-2 if lora else 3e-3, max_grad_norm=1.0, weight_decay=0.01),
            shape=shape,
            grad_accum=2,
            plan=plan,
            pipeline=pipeline,
            hybrid=hybrid,
        ),
        data=RandomBatches(
            cfg.vocab_size, batch_size=batch_size, seq_len=16, grad_accum=2, seed=1, repeat=True
        ),
        steps=steps,
        profiles=ProfileSource(memory_caps=(), keys=()),
        return_state=True,
        keep_records=keep_records,
    )


def recomputing(j: FinetuneJob, on: bool = True) -> FinetuneJob:
    """``j`` with activation checkpointing on (``--gradient-checkpointing``) or off."""
    source = dataclasses.replace(j.session.source, recompute=on)
    return dataclasses.replace(j, session=dataclasses.replace(j.session, source=source))


def single(j: FinetuneJob) -> WorkerResult:
    """The oracle: the same job with ``single``, in this process, on one device."""
    spec = dataclasses.replace(
        j.session, strategy=Strategy.SINGLE, plan=None, pipeline=None, hybrid=None
    )
    ctx = WorkerContext(0, 1, "local", TPGroup(), 0.0, ("local",))
    return finetune_worker(ctx, dataclasses.replace(j, session=spec, keep_records=False))


def check_pipeline_records(records: Sequence[StepRecord], name: str) -> Counter[str]:
    """One pipeline step's records add up (compute + transfer + idle = the step, per
    device) and every message waited for was sent; returns the messages, by name."""
    assert is_pipeline(records)
    for d in analyze_pipeline_step(records).devices:
        assert 0.0 <= d.idle_ratio <= 1.0, (name, d)
        total = d.compute_s + d.transfer_s + d.idle_s
        assert total == pytest.approx(d.step_time_s, rel=1e-6, abs=1e-9), (name, d)
    sent = Counter(s.name[5:] for r in records for s in r.collectives if s.name.startswith("send:"))
    got = Counter(s.name[5:] for r in records for s in r.collectives if s.name.startswith("recv:"))
    assert sent == got and sent, name
    return got
