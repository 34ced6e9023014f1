"""Can this path be written? Asked before work is spent, so a run never fails after its engines ran.

Every place the harness writes a user-chosen path (the ledger, its rendering and receipts, a
report's folder, the fixture cache) checks it here first and refuses with ``InvalidInput``
(exit 2, one line) when it cannot be written.

"Writable" means: the path exists with the expected kind (a regular file, or a directory) and
may be written, or it does not exist and its nearest existing ancestor is a directory that may
be written (so it can be created). "May be written" is ``os.access(W_OK)`` *and* at least one
write bit set in the mode: a file or folder someone made read-only (``chmod a-w``) is treated as
read-only even for root, who could write it anyway, because read-only is a statement of intent
(a frozen ledger, a shared cache).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from harness.errors import InvalidInput


def process_umask() -> int:
    """The process's umask, read from ``/proc/self/status`` where it is shown (Linux), else by
    setting and restoring it (``os.umask`` has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under the process's umask (0o666 & ~umask: 0o644
    under the usual 022). Files made through ``tempfile.mkstemp`` (always 0600) are set to it, so
    receipts and thresholds.yaml are readable by whoever the umask lets read them."""
    return 0o666 & ~process_umask()


def _may_write(path: Path, st: os.stat_result) -> bool:
    return bool(st.st_mode & 0o222) and os.access(path, os.W_OK)


def _nearest_existing(path: Path) -> tuple[Path, os.stat_result]:
    p = path
    while True:
        try:
            return p, os.stat(p)
        except FileNotFoundError:
            if p.parent == p:
                raise
            p = p.parent
        except NotADirectoryError:  # a component above is a regular file
            p = p.parent


def _check_creatable(path: Path, what: str) -> None:
    anc, st = _nearest_existing(path.absolute())
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInput(f"{path}: cannot create the {what}: {anc} is not a directory")
    if not _may_write(anc, st):
        raise InvalidInput(f"{path}: cannot create the {what}: {anc} is read-only")


def require_writable_file(path: str | os.PathLike, what: str, *, replace: bool = False) -> Path:
    """Refuse (``InvalidInput``) unless ``path`` is a writable regular file or can be created.

    ``replace`` True: the file is rewritten by renaming a new file over it, so a symlink is
    refused (the rename would overwrite the link, not what it points to) and the folder must be
    writable too. Returns ``path`` as a ``Path``.
    """
    path = Path(path)
    try:
        st = os.lstat(path) if replace else os.stat(path)
    except FileNotFoundError:
        _check_creatable(path, what)
        return path
    except NotADirectoryError:
        _check_creatable(path, what)  # raises: a component above is not a directory
        return path
    except OSError as e:
        raise InvalidInput(f"{path}: cannot use as the {what}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidInput(f"{path}: the {what} is a symbolic link; refusing to write through or over it")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{path}: the {what} is not a regular file")
    if not _may_write(path, st):
        raise InvalidInput(f"{path}: the {what} is read-only")
    if replace and not _may_write(path.parent, os.stat(path.parent)):
        raise InvalidInput(f"{path}: the {what} cannot be replaced: {path.parent} is read-only")
    return path


def require_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Refuse (``InvalidInput``) unless ``path`` is a writable directory or can be created."""
    path = Path(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        _check_creatable(path, what)
        return path
    except OSError as e:
        raise InvalidInput(f"{path}: cannot use as the {what}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInput(f"{path}: the {what} is not a directory")
    if not _may_write(path, st):
        raise InvalidInput(f"{path}: the {what} is read-only")
    return path


MAX_INPUT_BYTES = 64 << 20
"""The most bytes an input file (prompts, thresholds, manifest) may have: ``read_limited`` stops
reading there, so ``--prompts /dev/zero`` is one INVALID line, not a MemoryError."""


def read_limited(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """At most ``limit`` bytes of ``path``. A FIFO or device is read as ``cat`` would read it
    (blocking until its writer writes or closes), but never past ``limit``. Raises
    ``InvalidInput`` naming ``path`` and ``what`` for an unreadable file or one larger than
    ``limit``."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise InvalidInput(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise InvalidInput(f"{p}: the {what} is larger than {limit:,} bytes; refused")
    return raw


def read_utf8(path: str | os.PathLike, what: str, hint: str = "", limit: int = MAX_INPUT_BYTES) -> tuple[bytes, str]:
    """A text file's bytes and its UTF-8 text (at most ``limit`` bytes: ``read_limited``). Raises
    ``InvalidInput`` (exit 2) naming ``path`` and ``what`` for an unreadable or oversized file, and
    the line and byte of the first invalid UTF-8 sequence (then ``hint``, e.g. what the file should
    hold): text is never silently altered."""
    p = Path(path)
    raw = read_limited(p, what, limit)
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise InvalidInput(f"{p}:{lineno}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}){hint}") from None
