"""``xronos finetune``: the product — fine-tune across the devices, evaluate, save.

With no arguments it runs the embedded default: the ``tiny`` preset on the built-in
smart-home data set across an emulated heterogeneous cluster sized to this host.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
import typing
from collections.abc import Iterator
from typing import Any

from xronos.runconfig import RunConfig, config_fields, field_docs


def register(sub: Any) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a model across (emulated) devices",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file with any of the options below ([finetune] table)")
    add_config_flags(p)
    p.set_defaults(run=run)


def add_config_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per RunConfig field (``grad_accum`` -> ``--grad-accum``), its help text
    taken from the field's docstring."""
    docs, hints = field_docs(), typing.get_type_hints(RunConfig)
    for f in config_fields():
        if f.name not in skip:
            _add_flag(p, f, hints[f.name], docs.get(f.name, ""))


def _add_flag(p: argparse.ArgumentParser, f: dataclasses.Field[Any], hint: Any, doc: str) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else "[]"
    text = f"{doc} (default: {default})" if default not in ("", None) else doc
    text = text.replace("%", "%%")
    if hint in (bool, bool | None):
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif typing.get_origin(hint) is list:
        p.add_argument(flag, nargs="+", default=None, metavar="PATH", help=text)
    else:
        kind = next((t for t in typing.get_args(hint) or (hint,) if t is not type(None)), str)
        p.add_argument(flag, type=kind, default=None, help=text)


def run(args: argparse.Namespace) -> int:
    with _sigterm_as_ctrl_c():
        return _run(args)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (``kill``, ``timeout``, a service manager's or a container's stop) stops the
    run as Ctrl-C does: every device after the step in flight, with a checkpoint, and the
    emulation torn down on the way out. A process started with SIGTERM ignored keeps
    ignoring it."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _run(args: argparse.Namespace) -> int:
    from xronos.run.elastic import launch_elastic
    from xronos.run.monitor import RunMonitor
    from xronos.run.prepare import accuracy, prepare_run, write_config
    from xronos.run.scripted import Script
    from xronos.run.worker import lead_result

    flags = {f.name: getattr(args, f.name) for f in config_fields()}
    prep = prepare_run(flags, args.config)
    cfg = prep.cfg  # with the default model and its settings filled in
    for line in prep.notes:
        print(line)
    print(
        f"model {cfg.model}: {prep.source.cfg.num_parameters() / 1e6:.1f} M parameters, "
        f"{'LoRA r=' + str(prep.source.lora.r) if prep.source.lora else 'full fine-tuning'}; "
        f"strategy {cfg.strategy}; {prep.job.steps} steps; run directory {prep.run_dir}"
    )
    names = [d.name for d in prep.cluster.devices]
    # --disturb, --leave, --rejoin: checked before anything is written
    script = Script(cfg, prep.run_dir, names, lambda line: monitor.say(line))
    write_config(prep)
    monitor = RunMonitor(
        prep.run_dir,
        prep.job.steps,
        lambda generated: accuracy(prep.tokenizer, generated, prep.eval_refs),
        tensorboard=cfg.tensorboard,
    )
    monitor.step_hooks.append(script.on_step)
    measuring = not prep.job.profiles.cached  # a restart may plan from known profiles
    try:
        results, prep = launch_elastic(prep, monitor)
    except KeyboardInterrupt:
        monitor.finish(monitor.losses[-1][0] if monitor.losses else 0)
        raise
    finally:
        script.stop()
    result = lead_result(results)
    summary = monitor.finish(result.step)
    if monitor.first_measured and measuring:  # the next run skips profiling
        from xronos.planner.profile import DeviceProfile
        from xronos.profiler.run import store_cached

        store_cached([DeviceProfile.from_dict(p) for p in monitor.first_measured])
    print()
    print(summary)
    if result.stopped:
        print(
            f"xronos: interrupted at step {result.step}; checkpoint saved; continue "
            f"with: xronos finetune --resume {prep.run_dir}",
            file=sys.stderr,
        )
        return 130
    return 0
