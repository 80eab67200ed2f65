"""Writing the files the commands produce (export, bench --json, schedule --json) whole or not at all."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text to path through a temporary file in the same folder, renamed over path once complete.

    A write that fails part way (disk full, quota, a signal) leaves path as it was, an earlier export
    included, instead of a truncated JSON file that a later import or reader would reject or misread.
    Raises OSError as open() would (IsADirectoryError for a folder)."""
    path = Path(path)
    if path.is_symlink():  # write where the link points, as open() would, and keep the link
        path = path.resolve()
    if path.exists() and not path.is_file() and not path.is_dir():
        # a device or pipe (/dev/stdout, a FIFO): written in place; renaming over it would replace the node
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        os.fchmod(fd, _mode_for(path))  # mkstemp's 0600 would make an export unreadable to others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode_for(path: Path) -> int:
    """The permission bits open() would leave: the existing file's, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
