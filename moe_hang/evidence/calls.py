"""What a c10d frame's arguments say about another rank (pure): the peer of a send or recv,
the root of a rooted collective (a broadcast's ``src``, a reduce's ``dst``). From py-spy's
``--locals`` (capture/pyspy.py keeps only these arguments) or the probe's records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class P2PCall:
    """A point-to-point call a thread is inside: ``recv`` from ``peer`` or ``send`` to it
    (global ranks; ``peer`` None when the argument was not visible)."""

    op: str  # send | recv
    peer: int | None
    tag: int | None = None
    group: str | None = None  # process-group name; None: the default group

    def describe(self) -> str:
        where = "from" if self.op == "recv" else "to"
        return f"{self.op} {where} rank {self.peer if self.peer is not None else '?'}"


# c10d point-to-point functions, and the argument naming the peer
P2P_FUNCS = {"send": ("send", "dst"), "isend": ("send", "dst"), "recv": ("recv", "src"),
             "irecv": ("recv", "src")}


def p2p_from_locals(function: str, values: dict[str, str]) -> P2PCall | None:
    """The call, from a c10d p2p frame's arguments as text (py-spy's ``repr``s, or the
    probe's ``str``s); a group-relative peer (``group_src``) is left unknown."""
    spec = P2P_FUNCS.get(function)
    if spec is None:
        return None
    op, arg = spec

    def num(key: str) -> int | None:
        v = values.get(key)
        try:
            return int(v) if v not in (None, "None") else None
        except ValueError:
            return None

    group = values.get("group")
    # py-spy shows a group as "<ProcessGroup at 0x...>", not its name
    named = group is not None and group != "None" and not group.startswith("<")
    return P2PCall(op, num(arg), num("tag"), group if named else None)


# c10d rooted collectives, and the argument naming the root (a global rank)
ROOTED_FUNCS = {"broadcast": "src", "broadcast_object_list": "src", "reduce": "dst",
                "gather": "dst", "gather_object": "dst", "scatter": "src",
                "scatter_object_list": "src"}


@dataclass(frozen=True)
class RootedCall:
    """A rooted collective a thread is inside (``broadcast`` from ``root``): every member
    must name the same root, or it never completes. ``arg`` names it as the call was given
    (``src``, or ``group_src``: a rank of the group, which its members share alike)."""

    op: str
    root: int
    arg: str = "src"
    default_group: bool | None = None  # ``group=None``; None: the argument was not seen


def _values(f: dict[str, Any]) -> dict[str, str]:
    return {str(v.get("name")): str(v.get("repr")) for v in f.get("locals") or []
            if isinstance(v, dict)}


def pyspy_p2p(raw: list[dict[str, Any]]) -> P2PCall | None:
    """With ``py-spy dump --locals``: the innermost c10d send/recv frame and its arguments."""
    for f in raw:
        if str(f.get("filename", "")).endswith("distributed_c10d.py") and \
                f.get("name") in P2P_FUNCS and f.get("locals"):
            return p2p_from_locals(str(f["name"]), _values(f))
    return None


def pyspy_root(raw: list[dict[str, Any]]) -> RootedCall | None:
    """With ``py-spy dump --locals``: the outermost c10d rooted collective whose root is
    visible (the call the job made: ``broadcast_object_list(src=...)`` passes the inner
    ``broadcast`` a ``group_src``), and that root."""
    for f in reversed(raw):
        arg = ROOTED_FUNCS.get(str(f.get("name")))
        if arg is None or not str(f.get("filename", "")).endswith("distributed_c10d.py"):
            continue
        values = _values(f)
        group = values.get("group")
        for name in (arg, f"group_{arg}"):
            if values.get(name, "").isdigit():
                # a group object's repr does not say which (the default one's too)
                return RootedCall(str(f["name"]), int(values[name]), name,
                                  True if group == "None" else None)
    return None
