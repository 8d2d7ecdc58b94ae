"""Reading and listing a directory that anyone with write access to the store's root may have changed.

Files: ``os.open`` with ``O_NOFOLLOW`` (a symlink to ``/dev/zero`` or to another tenant's file is refused, not
followed) and ``O_NONBLOCK`` (a FIFO named like an entry cannot block the reader); then ``fstat``: a regular
file only, of a size under the cap, whose header declares exactly that size and tensors that fit the model
(:func:`~kvboost_core.store.serialize.check_geometry`), before the payload is read.

Directories: every path below the store's root is opened one component at a time relative to its parent's
descriptor, with ``O_NOFOLLOW | O_DIRECTORY`` (:func:`open_subdir`), and every listing, read, write and unlink
goes through those descriptors (``dir_fd=``). A namespace, model or shard directory that is a symlink (to
another tenant's directory, say) is never followed, so ``clear()`` and eviction cannot reach outside the
store's own directory.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvboost_core.store.base import KVGeometry
from kvboost_core.store.serialize import (
    HEADER_LIMIT,
    CorruptEntry,
    ForeignEntry,
    check_geometry,
    parse_header,
)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_NOT_A_DIR = (errno.ELOOP, errno.ENOTDIR)  # what O_NOFOLLOW | O_DIRECTORY answers for a symlink or a file


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def open_subdir(parent_fd: int, name: str, *, create: bool = False) -> int:
    """A descriptor of ``name`` in ``parent_fd``, never through a symlink. FileNotFoundError when absent (and
    not ``create``); NotADirectoryError when it is a symlink or not a directory."""
    if create:
        try:
            os.mkdir(name, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in _NOT_A_DIR:
            raise NotADirectoryError(e.errno, f"{name!r} is a symlink or not a directory") from e
        raise


@contextmanager
def subdir(parent_fd: int, name: str, *, create: bool = False) -> Iterator[int | None]:
    """``open_subdir`` as a context: None when ``name`` is absent, a symlink or not a directory."""
    try:
        fd = open_subdir(parent_fd, name, create=create)
    except (FileNotFoundError, NotADirectoryError):
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def open_store_dir(root: Path, parts: tuple[str, ...]) -> int:
    """``root/parts[0]/parts[1]/...``, created as needed, as a descriptor. The root itself is the caller's
    (it may be a symlink); below it no component may be one: ValueError naming it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    path = root
    try:
        for part in parts:
            path = path / part
            try:
                child = open_subdir(fd, part, create=True)
            except NotADirectoryError:
                raise ValueError(f"disk store: {path} is a symlink or not a directory; the disk tier never "
                                 "follows links below its root (another tenant's directory could be behind it)"
                                 ) from None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            raise CorruptEntry("file shrank while being read")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_entry_file(name: str | Path, max_bytes: int, *, dir_fd: int | None = None,
                    geometry: KVGeometry | None = None) -> tuple[bytes, int]:
    """The entry's bytes and inode. FileNotFoundError when absent; CorruptEntry for anything that is not a
    plausible entry file (a link, a FIFO, a device, a directory, a header that lies about the size or declares
    tensors of another model); ForeignEntry for a file over ``max_bytes`` or a chunk longer than ``geometry``'s
    (it may be another engine's: left alone). Nothing past the header is read unless it all checks out."""
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symlink; anything else unreadable is not served either
        raise CorruptEntry(f"cannot open: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptEntry("not a regular file")
        if st.st_size < 8:
            raise CorruptEntry(f"{st.st_size} bytes is not a plausible entry size")
        if st.st_size > max_bytes:
            raise ForeignEntry(f"{st.st_size} bytes is over this reader's {max_bytes}-byte entry cap")
        head = read_exact(fd, 8)
        head += read_exact(fd, min(int.from_bytes(head, "little"), HEADER_LIMIT, st.st_size - 8))
        header, size = parse_header(head)
        if size != st.st_size:  # checked before the payload is read: a lying header reads nothing more
            raise CorruptEntry(f"file is {st.st_size} bytes, header declares {size} (truncated?)")
        if geometry is not None:
            check_geometry(header, geometry)
        return head + read_exact(fd, st.st_size - len(head)), st.st_ino
    finally:
        os.close(fd)
