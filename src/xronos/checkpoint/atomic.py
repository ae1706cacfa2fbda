"""Directory-level atomic writes: stage in a sibling temp directory, fsync, rename.

A reader sees either no directory, the previous one, or the complete new one. POSIX
``rename`` of a directory onto an existing non-empty one fails, so a replaced directory
is first moved aside (``<name>.old-<pid>``) and removed only after the new one is in
place; during that short window the name is absent, never half-written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from xronos.errors import UserError


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (new names, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_path(final: Path, pid: int) -> Path:
    """The temp sibling ``<final>.tmp-<pid>`` a directory is written into."""
    return final.with_name(f"{final.name}.tmp-{pid}")


def replace_dir(staged: Path, final: Path) -> None:
    """Move the fully written ``staged`` directory to ``final`` (replacing an old one)."""
    for f in staged.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(staged)
    old: Path | None = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    try:
        os.rename(staged, final)
    except BaseException:
        if old is not None:
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(final: str | os.PathLike[str], replaceable: Collection[str]) -> Iterator[Path]:
    """Yield an empty temp directory; on normal exit it becomes ``final`` atomically, on an
    exception it is removed.

    Args:
        final: the directory to produce.
        replaceable: file names an earlier output of the same kind may hold; an existing
            ``final`` holding anything else is refused rather than replaced.
    """
    final = Path(final)
    if final.exists():
        foreign = (
            [final.name]
            if not final.is_dir()
            else sorted(p.name for p in final.iterdir() if p.name not in replaceable)
        )
        if foreign:
            raise UserError(
                f"{final}: exists and holds {', '.join(foreign[:3])}; "
                "pass a new output directory or remove it"
            )
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(final, os.getpid())
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    try:
        yield staged
        replace_dir(staged, final)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
