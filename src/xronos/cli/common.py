"""Argument helpers shared by the sub-commands."""

from __future__ import annotations

import argparse

from xronos.errors import UserError


def parse_shares(text: str | None, devices: int) -> list[float]:
    """``"2,1,1"`` -> [2.0, 1.0, 1.0]; one entry per device, each a positive number."""
    if devices < 1:
        raise UserError(f"--devices must be at least 1, got {devices}")
    if text is None:
        return [1.0] * devices
    parts = [p.strip() for p in text.split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        raise UserError(f"--shares {text!r}: expected comma-separated numbers like 2,1,1") from None
    if len(shares) != devices:
        raise UserError(
            f"--shares has {len(shares)} entries but --devices is {devices}; "
            "give one share per device"
        )
    if any(not s > 0 for s in shares):
        raise UserError(f"--shares {text!r}: every share must be a positive number")
    return shares


def add_comm_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--comm-dtype``, as ``xronos finetune`` takes it (``RunConfig.comm_dtype``)."""
    p.add_argument(
        "--comm-dtype",
        default="bf16",
        choices=("fp32", "bf16"),
        help="dtype activations travel in: TP's all-reduces, a pipeline's messages "
        "(default: %(default)s; fp32 is exact)",
    )


def add_model_arg(p: argparse.ArgumentParser, default: str | None = "tiny") -> None:
    p.add_argument(
        "--model",
        default=default,
        required=default is None,
        help="preset name (tiny, small), Hugging Face model directory or .gguf file "
        "(default: %(default)s)",
    )


def add_link_args(p: argparse.ArgumentParser) -> None:
    """``--bandwidth``, ``--latency`` and ``--no-network``, as ``xronos bench`` and ``xronos
    profile`` take them (:meth:`~xronos.emulation.cluster.LinkRequest.from_flags`)."""
    p.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="give every device a link of this bandwidth, e.g. 1Gbit, 200Mbit (network on)",
    )
    p.add_argument(
        "--latency",
        metavar="T",
        help="give every device a link of this one-way latency, e.g. 2ms (network on)",
    )
    p.add_argument(
        "--no-network",
        action="store_true",
        help="do not emulate the links the cluster declares (devices talk over loopback)",
    )
