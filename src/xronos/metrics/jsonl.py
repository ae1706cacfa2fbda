"""``metrics.jsonl``: one JSON object per training step, appended and flushed line by line,
so a run that dies keeps every finished step and ``tail -f`` shows progress.

Non-finite floats (a NaN loss) are written as ``null``: every line stays strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from xronos.errors import UserError


def _finite(value: Any) -> Any:
    """``value`` with NaN / ±inf replaced by None, recursively; objects with ``to_dict``
    are converted."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _finite(to_dict())
    return value


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (created with its parent directory).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A line cut short by a crash must not swallow the first line written now.
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")

    def write(self, record: Any) -> None:
        """Append ``record`` (a dict, or an object with ``to_dict()``) as one line."""
        if self._file is None:
            raise ValueError(f"metrics writer for {self.path} is closed")
        line = json.dumps(_finite(record), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All objects of a ``metrics.jsonl`` file; blank lines are skipped."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{number}: not valid JSON ({e.msg}); remove or repair that line"
                ) from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{number}: expected a JSON object per line")
            out.append(obj)
    return out
