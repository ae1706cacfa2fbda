"""``xronos finetune`` in the parent process: data, cluster, launch, progress, results.

The parent prepares everything that can fail on user input *before* any worker starts
(model, tokenizer, data, cluster, plan file), then launches one worker per device and
turns their events into the console progress, ``metrics.jsonl``, the evaluation metric
and, at the end, ``summary.md`` with its plots.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from xronos.data import (
    Example,
    Tokenizer,
    check_vocab,
    encode_prompt,
    load_examples,
    smarthome,
    split_train_eval,
    tokenize,
)
from xronos.emulation import ClusterSpec, load_cluster
from xronos.errors import RunComplete, UserError
from xronos.model.gguf_resolve import resolve_tokenizer
from xronos.model.lora import LoRAConfig
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan, default_mlp_chunk, default_vocab_chunk
from xronos.profiler.measure import Shape
from xronos.profiler.run import load_cached, profile_key
from xronos.run.givenplan import GivenPlan, check_plan, read_plan, strategy_for
from xronos.run.launch import DEFAULT_CPU_PERIOD_US, fastest_device, measurement_context
from xronos.run.opening import SessionSpec
from xronos.run.sessions import ProfileSource
from xronos.run.worker import FinetuneJob, finetune_worker
from xronos.runconfig import (
    BASE_DTYPES,
    RunConfig,
    build_config,
    load_toml,
    resolve_default_model,
)
from xronos.train.batches import DatasetBatches
from xronos.train.optim import OptimConfig
from xronos.train.session import EvalSpec, Strategy
from xronos.train.source import ModelSource
from xronos.utils import atomic_write_text

DEFAULT_STEPS = 400


@dataclass
class Prepared:
    """Everything checked and built before the workers start."""

    cfg: RunConfig
    source: ModelSource
    tokenizer: Tokenizer
    cluster: ClusterSpec
    job: FinetuneJob
    eval_refs: list[str]
    run_dir: Path
    notes: list[str] = field(default_factory=list)


def _examples(cfg: RunConfig, tok: Tokenizer) -> tuple[list[Example], list[Example]]:
    if not cfg.data:
        train = smarthome.generate("train", cfg.train_size, seed=cfg.seed)
        return train, smarthome.generate("eval", max(cfg.eval_size, 1), seed=cfg.seed)
    examples = load_examples(cfg.data, tok)
    if cfg.eval_data:
        return examples, load_examples(cfg.eval_data, tok)
    train, held = split_train_eval(examples, cfg.eval_fraction, seed=cfg.seed)
    return list(train), list(held)


def _lora(cfg: RunConfig, source: ModelSource) -> LoRAConfig | None:
    full = cfg.full if cfg.full is not None else source.model_dir is None
    if full:
        return None
    return LoRAConfig(r=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)


def _steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    if cfg.steps:
        return cfg.steps
    if cfg.epochs:
        return max(1, math.ceil(cfg.epochs * batches_per_epoch / cfg.grad_accum))
    return DEFAULT_STEPS


def _plan_for(
    cfg: RunConfig,
    strategy: Strategy,
    source: ModelSource,
    cluster: ClusterSpec,
    given: GivenPlan | None,
) -> GivenPlan | None:
    devices = [d.name for d in cluster.devices]
    if given is not None:
        assert cfg.plan is not None
        check_plan(cfg.plan, given, source.cfg, devices)
        return given
    if strategy is Strategy.TP_EVEN:
        return Plan.even(source.cfg, devices)
    if strategy is Strategy.SINGLE:
        return Plan.single(source.cfg, devices[0])
    return None


def prepare(cfg: RunConfig, cluster: ClusterSpec | None = None) -> Prepared:
    """Resolve and check every input; nothing is started and nothing is written.
    ``cluster`` overrides ``cfg.cluster`` (the machines of a torchrun run)."""
    cfg, model_note = resolve_default_model(cfg)
    strategy = Strategy.parse(cfg.strategy)
    given = read_plan(cfg.plan) if cfg.plan is not None else None
    if given is not None:  # a given plan runs under its own kind's strategy
        assert cfg.plan is not None
        strategy = strategy_for(cfg.plan, given, strategy)
    source = ModelSource.from_name(cfg.model, cfg.seed)
    source = replace(
        source,
        base_dtype=getattr(torch, BASE_DTYPES[cfg.base_dtype]),
        recompute=cfg.gradient_checkpointing,
    )
    if cfg.seq_len > source.cfg.max_position_embeddings:
        raise UserError(
            f"--seq-len {cfg.seq_len} exceeds the model's context of "
            f"{source.cfg.max_position_embeddings} tokens; lower --seq-len"
        )
    source = replace(source, lora=_lora(cfg, source))
    if cfg.base_dtype != "fp32" and source.lora is None:
        raise UserError(f"--base-dtype {cfg.base_dtype} needs LoRA (frozen base weights)")
    if cfg.base_dtype != "fp32" and strategy.is_pipeline:
        raise UserError(
            f"--base-dtype {cfg.base_dtype}: pipelines pass fp32 activations; use "
            "--strategy xronos, tp-even or single, or --base-dtype fp32"
        )
    tok = resolve_tokenizer(cfg.model)
    check_vocab(tok, source.cfg.vocab_size)
    train_ex, eval_ex = _examples(cfg, tok)
    train = tokenize(train_ex, tok, cfg.seq_len, truncation=cfg.truncation)  # type: ignore[arg-type]
    if len(train) < cfg.batch_size:
        raise UserError(
            f"the training data has {len(train)} usable examples, fewer than --batch-size "
            f"{cfg.batch_size}; add data or lower --batch-size"
        )
    evald = tokenize(eval_ex, tok, cfg.seq_len, truncation="drop") if eval_ex else None
    scored = [e for e in eval_ex if e.prompt and e.completion][: cfg.eval_size]
    cluster = cluster or load_cluster(cfg.cluster)
    cluster = cfg.link().apply(cluster)  # --bandwidth/--latency: every device on that link
    if strategy is Strategy.HYBRID and len(cluster.devices) < 3:
        raise UserError(
            f"--strategy hybrid needs three devices or more (two on faster links than a "
            f"third's); cluster {cluster.name!r} has {len(cluster.devices)}; use --strategy auto"
        )
    if strategy is Strategy.SINGLE:
        fastest = cluster.devices[fastest_device(cluster)]
        cluster = ClusterSpec(name=f"{cluster.name}:{fastest.name}", devices=(fastest,))
    shape = Shape(
        cfg=source.cfg,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        mlp_chunk=default_mlp_chunk(source.cfg.intermediate_size),
        vocab_chunk=default_vocab_chunk(source.cfg.vocab_size),
        lora=source.lora,
        recompute=source.recompute,
    )
    context = measurement_context(
        cluster,
        emulate=cfg.emulate,
        cpu_period_us=DEFAULT_CPU_PERIOD_US,
        network=cfg.link().network,
    )
    keys = tuple(profile_key(c, shape) for c in context)
    cached = load_cached(list(keys))
    eos = tuple(i for i in (tok.eos_id,) if i is not None)
    batches = len(train) // cfg.batch_size
    steps = _steps(cfg, batches)
    run_dir = Path(cfg.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    planned = _plan_for(cfg, strategy, source, cluster, given)
    job = FinetuneJob(
        session=SessionSpec(
            source=source,
            strategy=strategy,
            optim=OptimConfig(
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                max_grad_norm=cfg.max_grad_norm,
                warmup_steps=cfg.warmup_steps,
                schedule=cfg.lr_schedule,
                total_steps=steps,
                bf16=cfg.bf16,
            ),
            shape=shape,
            grad_accum=cfg.grad_accum,
            plan=planned if isinstance(planned, Plan) else None,
            pipeline=planned if isinstance(planned, PipelinePlan) else None,
            hybrid=planned if isinstance(planned, HybridPlan) else None,
            comm_dtype=cfg.comm_dtype,
            overlap=cfg.overlap,
        ),
        data=DatasetBatches(
            train, cfg.batch_size, seed=cfg.seed, pad_id=tok.pad_id, grad_accum=cfg.grad_accum
        ),
        steps=steps,
        profiles=ProfileSource(
            memory_caps=tuple(d.memory_bytes for d in cluster.devices),
            keys=keys,
            cached=tuple(cached) if cached else None,
        ),
        eval=EvalSpec(
            dataset=evald,
            prompts=tuple(
                tuple(encode_prompt(tok, e.prompt, add_special_tokens=not e.chat)) for e in scored
            ),
            max_new_tokens=cfg.max_new_tokens,
            eos_ids=eos,
            batch_size=cfg.batch_size,
            pad_id=tok.pad_id,
        ),
        seed=cfg.seed,
        eval_every=cfg.eval_every,
        save_every=cfg.save_every,
        keep=cfg.save_total_limit,
        run_dir=str(run_dir),
        rebalance=cfg.rebalance,
    )
    notes = [*([model_note] if model_note else []), train.summary()]
    if evald is not None:
        notes.append("eval: " + evald.summary())
    return Prepared(cfg, source, tok, cluster, job, [e.completion for e in scored], run_dir, notes)


def write_config(prep: Prepared) -> None:
    """The resolved configuration, so that a run can be understood and repeated."""
    prep.run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {
        "config": asdict(prep.cfg),
        "model": prep.source.cfg.to_hf_dict(),
        "lora": asdict(prep.source.lora) if prep.source.lora else None,
        "cluster": prep.cluster.to_dict(),
        "steps": prep.job.steps,
        "command": " ".join(["xronos", *sys.argv[1:]]),
    }
    atomic_write_text(prep.run_dir / "config.json", json.dumps(resolved, indent=2, default=str))


def accuracy(tok: Tokenizer, generated: list[list[int]], refs: list[str]) -> float | None:
    if not refs:
        return None
    preds = [tok.decode(g) for g in generated]
    return smarthome.exact_match(preds, refs)


def launch_job(
    prep: Prepared,
    on_event: Any,
    stop_when: Callable[[], bool] | None = None,
    lost: Sequence[str] = (),
) -> list[Any]:
    """The job's workers on its cluster; their results. ``stop_when``: polled while they
    run, True asks them to stop after the step with a checkpoint; ``lost``: the devices
    the run lost (in ``devices.json``)."""
    from xronos.run.launch import run_on_cluster

    cfg = prep.cfg
    return run_on_cluster(
        finetune_worker,
        [prep.job] * prep.cluster.world_size,
        prep.cluster,
        emulate=cfg.emulate,
        network=cfg.link().network,
        timeout_s=cfg.timeout,
        on_event=on_event,
        stop_signal=signal.SIGUSR1,  # finetune workers stop after the step and checkpoint
        stop_when=stop_when,
        devices_file=prep.run_dir / "devices.json",
        lost=lost,
    )


def saved_config(run_dir: str) -> dict[str, Any]:
    """The settings a run was started with (its ``config.json``), as a config layer."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"--resume {run_dir}: not a run directory (no config.json)")
    try:
        saved = json.loads(path.read_text())["config"]
    except (json.JSONDecodeError, KeyError) as e:
        raise UserError(f"--resume {run_dir}: unreadable config.json ({e})") from None
    return {k: v for k, v in saved.items() if k not in ("resume", "out")} | {"out": run_dir}


def prepare_run(
    flags: dict[str, Any],
    config: str | None,
    cluster: ClusterSpec | None = None,
    *,
    restart: bool = False,
) -> Prepared:
    """The finetune options as the command line gives them — defaults < the ``--config``
    TOML < a resumed run's own settings < flags — checked and prepared (``--resume``: from
    the run's newest checkpoint). ``cluster`` overrides the configured cluster. A new run
    is refused an ``--out`` that holds another run's checkpoints (a later ``--resume``
    would continue that run's), unless ``restart``: torchrun starting the same job again
    before its first checkpoint."""
    base = load_toml(config) if config else {}
    if flags.get("resume"):
        base = saved_config(str(flags["resume"])) | base
    cfg = build_config(base, flags)
    if cfg.resume:
        return resume_job(cfg, cluster)
    if cfg.out and not restart:
        _refuse_a_used_out(cfg.out)
    return prepare(cfg, cluster=cluster)


def _refuse_a_used_out(out: str) -> None:
    from xronos.checkpoint import latest_checkpoint, read_checkpoint_meta

    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        step = read_checkpoint_meta(ckpt)["step"]
        raise UserError(
            f"--out {out} already holds a run (its newest checkpoint is at step {step}); "
            f"continue it with --resume {out}, or choose another --out"
        )


def resume_job(cfg: RunConfig, cluster: ClusterSpec | None = None) -> Prepared:
    """``prepare`` for a run that continues from its latest complete checkpoint."""
    from dataclasses import replace

    from xronos.checkpoint import latest_checkpoint, read_checkpoint_meta

    assert cfg.resume is not None
    ckpt = latest_checkpoint(cfg.resume)
    if ckpt is None:
        raise UserError(f"--resume {cfg.resume}: no complete checkpoint to continue from")
    meta = read_checkpoint_meta(ckpt)
    prep = prepare(replace(cfg, out=cfg.resume), cluster=cluster)
    if int(meta["step"]) >= prep.job.steps:
        raise RunComplete(
            f"--resume {cfg.resume}: its checkpoint is at step {meta['step']} of "
            f"{prep.job.steps}; pass a larger --steps to train further"
        )
    prep.job = replace(prep.job, resume=str(ckpt))
    prep.notes.append(f"resuming from {ckpt} (step {meta['step']})")
    return prep
