"""Small files written so that a reader sees either the old content or the new, never a torn one."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from qwen3_pretrain.errors import UserError


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, flush it to disk, then rename it over ``path``."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    write_text_atomic(path, json.dumps(data, indent=indent, default=str) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary name beside ``path`` (unique to this process, same suffix, so writers that go by
    the suffix still work); it is renamed over ``path`` when the block succeeds and removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def make_dirs(path: str | os.PathLike, what: str) -> Path:
    """Create directory ``path`` and its parents; a path that cannot be created is the user's error,
    named by ``what`` (the config key or option that gave it)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{what} {str(path)!r}: cannot create this directory ({exc.strerror or exc}); "
                        f"choose a writable location") from None
    return path
