"""A directory every node sees (``--shared-dir``) as a channel (:class:`DirChannel`), for
clusters where the store cannot be reached from outside the ranks."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from moe_hang.runtime.coord.channel import ChannelGone, _check_key, _node_sort_key, key_prefix
from moe_hang.runtime.coord.worker import T, _first_line, _Worker


class DirChannel:
    """Files under ``<root>/moe-hang/<run key>/``. Writers write a temporary file and rename
    it (readers never see half a value); first-writer-wins is a hard link (atomic on NFS too),
    or O_EXCL where the file system has no links. On NFS, directory listings may be cached:
    members are also probed by name (``hint``), which close-to-open consistency keeps fresh."""

    kind = "dir"

    def __init__(self, root: str | os.PathLike[str], run: str, *, op_timeout: float = 5.0,
                 poll_s: float = 0.05) -> None:
        self.base = Path(root)
        self.root = self.base / key_prefix(run)
        self.op_timeout = op_timeout
        self.poll_s = poll_s
        self._gone: str | None = None
        self._worker = _Worker("moe-hang-dir")
        self._tag = f"{socket.gethostname()}.{os.getpid()}"

    @property
    def gone(self) -> str | None:
        return self._gone

    def describe(self) -> str:
        return f"directory {self.root}"

    def _op(self, what: str, fn: Callable[[], T]) -> T:
        if self._gone:
            raise ChannelGone(self._gone)
        try:
            return self._worker.call(fn, self.op_timeout)
        except Exception as exc:
            if self._gone is None:
                self._gone = f"shared directory {self.root}: {what}: {_first_line(exc)}"
            raise ChannelGone(self._gone) from None

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _tmp(self, p: Path) -> Path:
        return p.with_name(f".{p.name}.{self._tag}.{threading.get_ident()}.tmp")

    def _write(self, p: Path, value: bytes) -> Path:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self._tmp(p)
        with open(tmp, "wb") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @staticmethod
    def _read(p: Path) -> bytes | None:
        try:
            data = p.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data or None  # an O_EXCL winner still writing: not there yet

    def put(self, key: str, value: bytes) -> None:
        p = self._path(key)

        def do() -> None:
            tmp = self._write(p, value)
            try:
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

        self._op("write", do)

    def get(self, key: str) -> bytes | None:
        p = self._path(key)
        return self._op("read", lambda: self._read(p))

    def put_first(self, key: str, value: bytes) -> bytes:
        p = self._path(key)

        def do() -> bytes:
            tmp = self._write(p, value)
            try:
                os.link(tmp, p)
                return value
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                try:  # no hard links here: O_EXCL (readers skip it while it is empty)
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    pass
                else:
                    with os.fdopen(fd, "wb") as f:
                        f.write(value)
                    return value
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            for _ in range(50):  # the winner's O_EXCL write may still be under way
                got = self._read(p)
                if got is not None:
                    return got
                time.sleep(0.02)
            raise OSError(f"{p} exists but stays empty")

        return self._op("write", do)

    def put_member(self, ns: str, name: str, value: bytes) -> None:
        self.put(f"{ns}/{name}", value)

    def members(self, ns: str, hint: Sequence[str] = ()) -> list[str]:
        d = self._path(ns)

        def do() -> list[str]:
            try:
                names = {n for n in os.listdir(d) if not n.startswith(".")}
            except (FileNotFoundError, NotADirectoryError):
                names = set()
            for h in hint:
                if h not in names and (d / h).exists():
                    names.add(h)
            return sorted(names, key=_node_sort_key)

        return self._op("list", do)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        paths = [self._path(k) for k in keys]
        return self._op("read", lambda: [self._read(p) for p in paths])

    def wait(self, key: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while True:
            if self.get(key) is not None:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.poll_s, left))

    def close(self) -> None:
        self._worker.close()
