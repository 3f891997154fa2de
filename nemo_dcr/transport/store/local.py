"""The embedded default store: a directory on a local or shared file system."""
from __future__ import annotations

import errno
import heapq
import os
import secrets
import stat
from typing import Callable

from nemo_dcr.transport.store.base import ObjectInfo, ObjectTooLarge, StoreError, SymlinkRefused, check_key, check_limit
from nemo_dcr.transport.store.policy import Attempt, BoundedStore, StorePolicy, one_line


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_PREFIX = ".tmp-"
_BLOCK = 8 << 20


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _local_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


class LocalDirStore(BoundedStore):
    """The embedded default: a directory on a local or shared file system.

    Paths below the root are walked one component at a time with ``O_NOFOLLOW``
    relative to the parent's descriptor, so a symbolic link anywhere below the root
    (say ``v -> /etc``) is refused rather than followed, with no window between a check
    and the use.  The root itself may be a link.

    ``create=False`` (a reader: a receiver, ``nemo-dcr status``): the root is never created,
    here or by a later ``put`` (which then fails), so a mistyped path leaves nothing behind;
    whether it exists is ``transport/preflight.check_store``'s question.
    """

    def __init__(self, root: str, *, policy: StorePolicy | None = None, create: bool = True):
        self._init_policy(policy)
        self.uri = root
        self.root = os.path.abspath(root.removeprefix("file://"))
        self.create = create
        try:
            if not create:  # a missing root is the preflight's to name; a path that cannot be one is refused here
                try:
                    os.stat(self.root)
                except FileNotFoundError:
                    pass
                return
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{root}: cannot open store: {one_line(e)}", uri=root, op="open") from None

    def _open_dir(self, parts: list[str], *, create: bool) -> int:
        """Descriptor of the directory ``root/parts...``, reached without following links."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, name in enumerate(parts):
                if create:
                    try:
                        os.mkdir(name, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                        raise SymlinkRefused(f"{'/'.join(parts[:i + 1])!r} is a symbolic link "
                                             f"(the local store follows no link below its root)") from None
                    raise
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    def put(self, key: str, data: bytes) -> None:
        self._publish(key, data, exclusive=False)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._publish(key, data, exclusive=True)

    def _publish(self, key: str, data: bytes, *, exclusive: bool) -> bool:
        """Write a temporary file beside ``key``, then rename it over ``key`` or, with
        ``exclusive``, hard-link it to ``key`` (``link(2)`` fails on an existing name:
        the one atomic create-if-absent every POSIX file system has, NFS included)."""
        parts = check_key(key).split("/")
        data = memoryview(data).cast("B")

        def attempt(att: Attempt) -> bool:
            fd = self._open_dir(parts[:-1], create=True)
            tmp = f"{_TMP_PREFIX}{secrets.token_hex(8)}"
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                              dir_fd=fd)
                try:
                    for i in range(0, len(data), _BLOCK):
                        view = data[i:i + _BLOCK]
                        while view:
                            view = view[os.write(out, view):]
                finally:
                    os.close(out)
                if att.abandoned:  # the caller gave up on this attempt: publish nothing
                    raise att.timed_out()
                if not exclusive:
                    os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
                    return True
                try:
                    os.link(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp, dir_fd=fd)
                return True
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=fd)
                except OSError:
                    pass
                raise
            finally:
                os.close(fd)

        return self._call("put", key, attempt, nbytes=len(data))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.get_with_info(key, max_bytes=max_bytes)[0]

    def get_with_info(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """The size check, the read and the version's identity all come from one opened
        descriptor (``fstat`` before and after the read), so they cannot race a rename.
        An object written in place during the read (its tag or length changes) fails
        the attempt transiently; the next attempt sees the new version."""
        parts = check_key(key).split("/")

        def attempt(att: Attempt) -> tuple[bytes, ObjectInfo]:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except NotADirectoryError:
                raise FileNotFoundError(key) from None
            try:
                try:
                    f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise SymlinkRefused(f"{key!r} is a symbolic link "
                                             f"(the local store follows no link below its root)") from None
                    raise
            finally:
                os.close(fd)
            with os.fdopen(f, "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError(key)
                if max_bytes is not None and st.st_size > max_bytes:
                    raise ObjectTooLarge(self.uri, key, st.st_size, max_bytes)
                att.add_bytes(st.st_size)
                data = fh.read(st.st_size + 1)  # never more than fstat said, plus one byte to see growth
                tag = _local_tag(st)
                if len(data) != st.st_size or _local_tag(os.fstat(fh.fileno())) != tag:
                    raise OSError(errno.EAGAIN, "the object changed while it was read")
                return data, ObjectInfo(key, st.st_size, tag)

        return self._call("get", key, attempt)

    def _lstat_attempt(self, key: str) -> Callable[[Attempt], ObjectInfo | None]:
        parts = check_key(key).split("/")

        def attempt(att: Attempt) -> ObjectInfo | None:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            finally:
                os.close(fd)
            if stat.S_ISLNK(st.st_mode):
                raise SymlinkRefused(f"{key!r} is a symbolic link (the local store follows no link below its root)")
            return ObjectInfo(key, st.st_size, _local_tag(st)) if stat.S_ISREG(st.st_mode) else None

        return attempt

    def stat(self, key: str) -> ObjectInfo | None:
        return self._call("stat", key, self._lstat_attempt(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self._lstat_attempt(key)) is not None

    def list(self, prefix: str, *, limit: int | None = None) -> list[str]:
        """A directory is read whole (its cost grows with what was planted in it); at most
        ``limit`` keys are kept and returned."""
        return [info.key for info in self.list_info(prefix, limit=limit)]

    def list_sizes(self, prefix: str, *, limit: int | None = None) -> list[tuple[str, int | None]]:
        return [(info.key, info.size) for info in self.list_info(prefix, limit=limit)]

    def list_info(self, prefix: str, *, limit: int | None = None) -> list[ObjectInfo]:
        """``list`` with each object's size and tag (the directory entry's ``lstat``)."""
        limit = check_limit(limit)
        parts = check_key(prefix.strip("/")).split("/") if prefix.strip("/") else []

        def walk(fd: int, rel: list[str], out: list[str]) -> None:
            with os.scandir(fd) as it:
                entries = list(it)
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    continue
                path = [*rel, entry.name]
                if entry.is_symlink():
                    raise SymlinkRefused(f"{'/'.join(path)!r} is a symbolic link "
                                         f"(the local store follows no link below its root)")
                if entry.is_dir(follow_symlinks=False):
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        walk(sub, path, out)
                    finally:
                        os.close(sub)
                elif entry.is_file(follow_symlinks=False):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted since the directory was read
                        continue
                    out.append(ObjectInfo("/".join(path), st.st_size, _local_tag(st)))

        def attempt(att: Attempt) -> list[ObjectInfo]:
            try:
                fd = self._open_dir(parts, create=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
            out: list[ObjectInfo] = []
            try:
                walk(fd, parts, out)
            finally:
                os.close(fd)
            by_key = lambda info: info.key  # noqa: E731
            return sorted(out, key=by_key) if limit is None else heapq.nsmallest(limit, out, key=by_key)

        return self._call("list", prefix, attempt)

    def delete(self, key: str) -> None:
        parts = check_key(key).split("/")

        def attempt(att: Attempt) -> None:
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                os.unlink(parts[-1], dir_fd=fd)  # a link itself may go: unlinking reaches nothing
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)

        self._call("delete", key, attempt)
