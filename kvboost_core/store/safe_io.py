"""Reading a file that anyone with write access to the store's directory may have planted.

``os.open`` with ``O_NOFOLLOW`` (a symlink to ``/dev/zero`` or to another tenant's file is refused, not
followed) and ``O_NONBLOCK`` (a FIFO named like an entry cannot block the reader); then ``fstat``: a regular
file only, of a size under the cap, whose header declares exactly that size, before the payload is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvboost_core.store.serialize import HEADER_LIMIT, CorruptEntry, parse_header

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            raise CorruptEntry("file shrank while being read")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_entry_file(path: Path, max_bytes: int) -> tuple[bytes, int]:
    """The entry's bytes and inode. FileNotFoundError when absent; CorruptEntry for anything that is not a
    plausible entry file (a link, a FIFO, a device, a directory, too big, a header that lies about the size)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink; anything else unreadable is not served either
        raise CorruptEntry(f"cannot open: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptEntry("not a regular file")
        if not 8 <= st.st_size <= max_bytes:
            raise CorruptEntry(f"{st.st_size} bytes is not a plausible entry size")
        head = read_exact(fd, 8)
        head += read_exact(fd, min(int.from_bytes(head, "little"), HEADER_LIMIT, st.st_size - 8))
        _, size = parse_header(head)
        if size != st.st_size:  # checked before the payload is read: a lying header reads nothing more
            raise CorruptEntry(f"file is {st.st_size} bytes, header declares {size} (truncated?)")
        return head + read_exact(fd, st.st_size - len(head)), st.st_ino
    finally:
        os.close(fd)
