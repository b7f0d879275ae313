"""User-facing errors: a one-paragraph message that names the fix; the CLI prints it without a traceback.

This module is the one place where errors the user's files and environment cause become UserErrors:
`reading(path, what, fix)` wraps a read-and-parse of a file the user supplied (config.json, tokenizer_config.json,
a checkpoint header, ...) and `from_os_error` words any OSError that reaches a command's top level (a read-only
cache dir, a planted symlink, a full disk). Every CLI entry point (cli.main, the server's boot thread) routes
exceptions through `user_error`, so the same cause always reads the same way and exits 2."""
from __future__ import annotations

import errno
import json
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class UserError(Exception):
    """A problem with the user's input or environment, not a bug. `param` names the offending field when there is
    one (a SamplingParams field, a request field), so the server can put it in the OpenAI error's "param"."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# What a parse of untrusted bytes raises when the bytes are wrong: bad JSON or UTF-8 (ValueError), missing keys,
# wrong types (a list where an object belongs: AttributeError on .get), absurd numbers (OverflowError), nesting.
PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError,
                struct.error)

_HINTS = {
    errno.EACCES: "check the permissions of that path, or point warmstart elsewhere (--cache-dir, "
                  "$WARMSTART_CACHE_DIR)",
    errno.EPERM: "check the permissions of that path, or point warmstart elsewhere (--cache-dir, "
                 "$WARMSTART_CACHE_DIR)",
    errno.EROFS: "the file system is read-only: pass a writable --cache-dir or set $WARMSTART_CACHE_DIR",
    errno.ENOSPC: "the disk is full: free some space or pass another --cache-dir",
    errno.EDQUOT: "the disk quota is exhausted: free some space or pass another --cache-dir",
    errno.ELOOP: "a symbolic link sits where warmstart expects its own file; remove it (it may have been planted "
                 "by another user)",
    errno.ENOENT: "the path does not exist",
    errno.ENOTDIR: "a file sits where a folder belongs; remove it or pass another path",
    errno.EISDIR: "a folder sits where a file belongs",
    errno.ENOMEM: "not enough memory: lower --memory-utilization or --kv-cache-memory, or free memory",
    errno.EADDRINUSE: "another process is using the port: stop it or pick another with --port",
}


def from_os_error(e: OSError, doing: str | None = None) -> UserError:
    """An OSError as one paragraph: what failed, on which path, and the fix its errno points to."""
    where = " ".join(repr(str(f)) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e) or type(e).__name__
    hint = _HINTS.get(e.errno, "check the path and the environment, then retry")
    head = f"{doing} failed: " if doing else ""
    return UserError(f"{head}{what}{': ' + where if where else ''}; {hint}.")


@contextmanager
def reading(path: Path | str, what: str, fix: str) -> Iterator[None]:
    """Around reading and interpreting one file the user supplied: OS and parse errors become one UserError that
    names the file, the problem and `fix`. UserErrors raised inside pass through unchanged."""
    try:
        yield
    except UserError:
        raise
    except OSError as e:
        raise from_os_error(e, f"reading {what} {path}") from None
    except PARSE_ERRORS as e:
        if isinstance(e, json.JSONDecodeError):
            detail = f"not valid JSON: {e}"
        elif isinstance(e, UnicodeDecodeError):
            detail = f"not UTF-8 text: {e}"
        elif isinstance(e, KeyError):
            detail = f"missing key {e}"
        elif isinstance(e, AttributeError):
            detail = f"wrong structure: {e}"
        else:
            detail = str(e)
        raise UserError(f"{what} {path} cannot be used ({detail[:300]}). {fix}") from None


def user_error(e: BaseException) -> UserError | None:
    """The UserError a top-level exception stands for, or None when it is a bug (which keeps its traceback)."""
    if isinstance(e, UserError):
        return e
    if isinstance(e, OSError):
        return from_os_error(e)
    return None
