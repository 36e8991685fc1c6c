"""Ranks whose number is not known. Pure.

A process that joined the job's process group but told nobody its rank (no probe, no launcher
variable, nothing in its frames) is still evidence: it may be the culprit. It is keyed
``-pid`` wherever ranks are keyed (evidence, analysis), so it can never pass for a rank
number, and every text or JSON a person or a program reads names it by PID, "PID 1234
(unidentified rank)" — never by a number the tool would have had to guess.
"""

from __future__ import annotations

import re
from typing import Any


def unidentified_key(pid: int) -> int:
    return -pid


def is_unidentified(rank: int) -> bool:
    return rank < 0


def pid_of(key: int) -> int:
    return -key


def rank_name(rank: int) -> str:
    """``rank 3``, or ``PID 1234 (unidentified rank)``."""
    return f"PID {pid_of(rank)} (unidentified rank)" if is_unidentified(rank) else f"rank {rank}"


def pids_text(pids: list[int]) -> str:
    if len(pids) == 1:
        return f"PID {pids[0]} (unidentified rank)"
    return "PIDs " + ", ".join(map(str, pids)) + " (unidentified ranks)"


_NUM = r"-?\d+"
_ITEM = rf"{_NUM}(?:-{_NUM})?"
# "rank 3", "ranks 0-3, 8", "ranks 0, 1 and 3" (analysis' and the report's rank lists)
_LIST = re.compile(rf"\b([Rr])anks? ({_ITEM}(?:(?:, | and ){_ITEM})*)")
_ITEM_RE = re.compile(rf"({_NUM})(?:-({_NUM}))?")


def _rewrite_list(m: re.Match[str]) -> str:
    items = re.split(r", | and ", m.group(2))
    known: list[str] = []
    pids: list[int] = []
    for item in items:
        im = _ITEM_RE.fullmatch(item)
        if im is None:
            return m.group(0)
        a = int(im.group(1))
        b = int(im.group(2)) if im.group(2) is not None else a
        if is_unidentified(a):
            pids += [pid_of(k) for k in range(a, b + 1)]  # a run of keys: consecutive pids
        else:
            known.append(item)
    if not pids:
        return m.group(0)
    pids.sort()
    if not known:
        return pids_text(pids)
    word = m.group(1) + ("ank " if len(known) == 1 and "-" not in known[0] else "anks ")
    return word + ", ".join(known) + " and " + pids_text(pids)


def relabel_text(text: str, keys: set[int]) -> str:
    """``text`` with every unidentified rank in ``keys`` named by its PID."""
    if not keys or not text:
        return text
    text = _LIST.sub(_rewrite_list, text)

    def bare(m: re.Match[str]) -> str:  # a key outside a rank list (e.g. "from -1234")
        k = int(m.group(0))
        return f"PID {pid_of(k)} (unidentified rank)" if k in keys else m.group(0)

    return re.sub(r"(?<![\w-])-\d+\b", bare, text)


def _key(k: str, keys: set[int]) -> str:
    try:
        n = int(k)
    except ValueError:
        return k
    return f"pid:{pid_of(n)}" if n in keys else k


def relabel_json(d: dict[str, Any]) -> dict[str, Any]:
    """A diagnosis dict (``Diagnosis.to_dict``) with no number for an unidentified rank: its
    ``ranks`` entry says ``"rank": null, "unidentified": true`` (the pid is there), rank-keyed
    maps key it ``pid:1234``, rank lists leave it out, and ``culprit_pids`` names every
    culprit by pid. A dict with no unidentified rank comes back as it was."""
    keys = {r["rank"] for r in d.get("ranks") or []
            if isinstance(r.get("rank"), int) and is_unidentified(r["rank"])}
    if not keys:
        return d
    out = dict(d)
    pids = {r["rank"]: r.get("pid") for r in d.get("ranks") or []}
    culprits = list(d.get("culprit_ranks") or [])
    out["culprit_ranks"] = [r for r in culprits if r not in keys]
    out["culprit_pids"] = sorted(p for r in culprits if (p := pids.get(r)) is not None)
    ranks = []
    for r in d.get("ranks") or []:
        r = dict(r)
        if r.get("rank") in keys:
            r["rank"], r["unidentified"] = None, True
        if r.get("note"):
            r["note"] = relabel_text(r["note"], keys)
        ranks.append(r)
    out["ranks"] = ranks
    for name in ("summary", "fix", "fix_code"):
        if isinstance(out.get(name), str):
            out[name] = relabel_text(out[name], keys)
    out["evidence"] = [relabel_text(str(e), keys) for e in d.get("evidence") or []]

    def divergence(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        x = dict(x)
        if isinstance(x.get("ranks"), list):
            x["ranks"] = [r for r in x["ranks"] if r not in keys]
        if isinstance(x.get("per_rank"), dict):
            x["per_rank"] = {_key(k, keys): v for k, v in x["per_rank"].items()}
        return x

    out["first_divergence"] = divergence(d.get("first_divergence"))
    if isinstance(d.get("divergences"), list):
        out["divergences"] = [divergence(x) for x in d["divergences"]]
    if isinstance(d.get("timeline"), dict) and isinstance(d["timeline"].get("ranks"), dict):
        out["timeline"] = dict(d["timeline"], ranks={_key(k, keys): v for k, v in
                                                     d["timeline"]["ranks"].items()})
    return out


# ----------------------------------------------------------------------------- from frames

RANK_LOCALS = ("rank", "global_rank")
WORLD_LOCALS = ("world_size", "world")
_LIBRARY = ("/site-packages/", "/dist-packages/")


def _int_repr(v: Any) -> int | None:
    s = str(v.get("repr", "")) if isinstance(v, dict) else ""
    return int(s) if s.isdigit() else None


def _is_user_frame(f: dict[str, Any]) -> bool:
    name, file = str(f.get("name", "")), str(f.get("filename", ""))
    if file.endswith("distributed_c10d.py"):
        return name == "init_process_group"  # its own rank= argument, during the rendezvous
    return not any(x in file for x in _LIBRARY)


def identity_from_locals(data: Any, pid: int) -> tuple[int | None, int | None]:
    """(rank, world size) from ``py-spy dump --locals`` of ``pid``'s main thread: the integer
    locals the job's own frames call ``rank``/``global_rank`` and ``world_size``/``world``
    (the DDP tutorial's ``main(rank, world_size)``, a script's ``rank = ...``), and
    ``init_process_group``'s arguments while it is inside it. Frames that disagree (a local
    rank beside a global one) give nothing: (None, None) rather than a guess."""
    threads = data.get("threads", []) if isinstance(data, dict) else data
    if not isinstance(threads, list):
        return None, None
    main = next((t for t in threads if isinstance(t, dict) and t.get("os_thread_id") == pid),
                next((t for t in threads if isinstance(t, dict)), None))
    if main is None:
        return None, None
    ranks: set[int] = set()
    worlds: set[int] = set()
    for f in main.get("frames") or []:
        if not isinstance(f, dict) or not _is_user_frame(f):
            continue
        for v in f.get("locals") or []:
            n = _int_repr(v)
            if n is None:
                continue
            if v.get("name") in RANK_LOCALS:
                ranks.add(n)
            elif v.get("name") in WORLD_LOCALS:
                worlds.add(n)
    rank = ranks.pop() if len(ranks) == 1 else None
    world = worlds.pop() if len(worlds) == 1 else None
    if rank is not None and world is not None and rank >= world:
        return None, None  # not one rank's view of one world: trust neither
    return rank, world
