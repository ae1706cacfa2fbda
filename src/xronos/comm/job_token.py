"""The job's token: read from a file or the environment, with the checks a careful Unix
tool makes (a file every user can read is refused, a short token is refused)."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping

from xronos.errors import UserError

TOKEN_ENV = "XRONOS_TOKEN"
MIN_TOKEN_CHARS = 16
"""A token is guessable offline from any exchange read off the store: it must be long."""
_NEW_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def load_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's token: the first line of ``token_file`` (stripped), else ``XRONOS_TOKEN``;
    ``None`` when neither is given. A file that every user can read or write is refused;
    one its group can read or write gets a warning (a group may hold a service's
    secrets, as PostgreSQL allows for its key)."""
    env = os.environ if environ is None else environ
    if token_file:
        text = _read_token_file(token_file)
        where = f"token file {token_file}"
    else:
        text = env.get(TOKEN_ENV, "").strip()
        where = TOKEN_ENV
        if not text:
            return None
    if not text:
        raise UserError(f"{where} is empty; put the job's token on its first line")
    if len(text) < MIN_TOKEN_CHARS:
        raise UserError(
            f"the token in {where} has {len(text)} characters; use at least "
            f"{MIN_TOKEN_CHARS} random ones, e.g. from {_NEW_TOKEN}"
        )
    return text.encode()


def _read_token_file(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read token file {path}: {e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise UserError(
            f"token file {path} can be read or written by every user (mode "
            f"{stat.S_IMODE(mode):o}); restrict it with `chmod 600 {path}`"
        )
    if mode & (stat.S_IRGRP | stat.S_IWGRP):
        print(
            f"xronos: warning: token file {path} can be read by its group (mode "
            f"{stat.S_IMODE(mode):o}); `chmod 600 {path}` keeps it to its owner",
            file=sys.stderr,
        )
    return first.strip()


def no_token_warning(endpoint: str) -> str:
    return (
        f"xronos: warning: no token ({TOKEN_ENV} or --token-file): any host that can reach "
        f"the rendezvous port {endpoint} can join this job"
    )
