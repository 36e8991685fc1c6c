"""What every coordination channel is (:class:`Channel`) and how its keys are made: one run's
namespace ``moe-hang/<run key>/``, key parts, node ids."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Protocol

ROOT = "moe-hang"
_INDEX = "_index"
_KEY_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]{0,127}$")


class ChannelGone(Exception):
    """The channel cannot be used any more (store gone, timed out, directory unreachable)."""


class Channel(Protocol):
    """Keys are relative to the channel's prefix: slash-separated parts of ``[A-Za-z0-9_.=+-]``.
    Values are bytes. Every method is bounded; a failure raises :class:`ChannelGone`."""

    kind: str

    @property
    def gone(self) -> str | None: ...

    def describe(self) -> str: ...

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def put_first(self, key: str, value: bytes) -> bytes:
        """Atomic first-writer-wins: store ``value`` unless the key exists; return what is
        stored (ours if we won)."""
        ...

    def put_member(self, ns: str, name: str, value: bytes) -> None:
        """``ns/name`` = value, and ``name`` listed by :meth:`members`."""
        ...

    def members(self, ns: str, hint: Sequence[str] = ()) -> list[str]:
        """Names put under ``ns`` (``hint``: names worth probing directly)."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def wait(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` seconds."""
        ...

    def close(self) -> None: ...


def sanitize(part: str) -> str:
    """A run id or node id as one key part."""
    out = re.sub(r"[^A-Za-z0-9_.=+-]", "_", part.strip())[:128]
    if not out or not out[0].isalnum():
        out = "x" + out[:127]
    return out


def key_prefix(run_key: str) -> str:
    return f"{ROOT}/{sanitize(run_key)}/"


def run_key(run_id: str | None, env: Mapping[str, str] | None = None) -> str:
    """The namespace of one job. torchrun's run id (``--rdzv-id``, ``TORCHELASTIC_RUN_ID``;
    ``none`` by default) is enough in a store that lives as long as the job; a shared directory
    outlives jobs, so the Slurm job and step ids are added where there are some."""
    e = os.environ if env is None else env
    key = run_id or "none"
    job = e.get("SLURM_JOB_ID")
    if job:
        key += f"-slurm{job}"
        if e.get("SLURM_STEP_ID"):
            key += f".{e['SLURM_STEP_ID']}"
    return sanitize(key)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not parts or not all(_KEY_PART.match(p) or p == _INDEX for p in parts):
        raise ValueError(f"bad coordination key {key!r}")
    return key


def _node_sort_key(n: str) -> tuple[int, int, str]:
    return (0, int(n), "") if n.isdigit() else (1, 0, n)
