"""Atomic writes: a reader (or a resumed run after a kill) sees the old version or the
new one, never a half-written file or folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text(path: str | os.PathLike, text: str) -> None:
    write_with(path, lambda staging: Path(staging).write_text(text))


def write_with(path: str | os.PathLike, writer: Callable[[str], object]) -> None:
    """`writer(staging_path)` writes the file; it then replaces `path` in one rename."""
    path = Path(path)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        writer(staging)
        os.chmod(staging, 0o644)  # mkstemp creates 0600
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


@contextmanager
def replace_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside `final`; when the block succeeds it takes
    `final`'s place in one rename (the previous folder is removed afterwards); when it
    fails, `final` is untouched and the staging folder is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield staging
        os.chmod(staging, 0o755)  # mkdtemp creates 0700
        for item in staging.iterdir():
            os.chmod(item, 0o644)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(staging, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
