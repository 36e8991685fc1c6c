"""The MoE routers of a rank: the tokens each expert got at each router call, and under
``moe-hang check`` a routing plan applied on one rank at one step (stdlib at import: loaded by
path into a job; torch is the job's, handed in). docs/DESIGN.md §15.

Routers are found by shape: a module with an ``experts`` child and a ``gate`` or ``router``
child is an MoE block (transformers' Mixtral, Qwen-MoE, DeepSeek-V3, GPT-OSS; NeMo Automodel's
and torchtitan's MoE; most hand-written ones), or ``MOE_HANG_ROUTER=pkg.mod.Class`` names the
router class. A global forward pre-hook looks for them until the first optimizer step; then
each router carries its own forward hook (a top-k and a bincount of what it computed). A plan
changes the router's output (or the block's input) only: the job's code decides what follows.
One line a router call is appended to ``ranks/rank{R}.routing.jsonl`` (rewritten past
``MAX_BYTES`` to the plan's calls and the last step).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ == "moe_hang.probe":
    from moe_hang.probe import routeplan
else:  # loaded by path (probe.py loads its sibling routeplan.py first, under this name)
    routeplan = sys.modules["moe_hang_probe_routeplan"]
Plan = routeplan.Plan
ENV_PLAN = routeplan.ENV_PLAN
ENV_ROUTER = "MOE_HANG_ROUTER"  # pkg.mod.Class: that class is a router
ENV_OFF = "MOE_HANG_ROUTING"  # "0": no counting, no plan
_ROUTER_ATTRS = ("gate", "router")
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "topk", "n_activated_experts", "k")
_COUNT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "n_experts",
                "out_features")
# wrappers whose prefix says nothing about the model (peft, torch.compile, DDP)
_WRAPPER_PREFIXES = ("base_model.model.", "_orig_mod.", "module.", "_fsdp_wrapped_module.")
MAX_BYTES = 256 << 10  # the file is rewritten past this (~1,500 router calls)
_MAX_ROOTS = 16  # the first modules called: the outermost (the model) is among them


@dataclass
class _Router:
    block: str | None  # the MoE block's name in the model; None until first called
    owner: Any  # the block (or the router itself, for a named router class)
    experts: int | None
    top_k: int | None
    calls: int = 0  # calls in the current step
    fused: bool = False  # every expert's weights in one module (3-D parameters [E, ...])


def _int_attr(objs: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            v = getattr(obj, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _strip(name: str) -> str:
    while any(name.startswith(p) for p in _WRAPPER_PREFIXES):
        name = name[len(next(p for p in _WRAPPER_PREFIXES if name.startswith(p))):]
    return name


class Routing:
    """The counting (and the plan) of one rank."""

    def __init__(self, torch: Any, rank: int, path: Path, plan: Plan | None = None,
                 router_class: str | None = None):
        self.torch, self.rank, self.path, self.plan = torch, rank, path, plan
        self.router_class = router_class
        self.step = 0
        self._routers: dict[int, _Router] = {}
        self._looked: set[int] = set()
        self._roots: list[Any] = []
        self._names: dict[int, dict[int, str]] = {}
        self._global: Any = None
        self._opt: int | None = None
        self._previous: list[bytes] = []  # the last complete step's lines
        self._current: list[bytes] = []
        self._planned: list[bytes] = []  # the plan's calls, kept: proof that it was applied
        self._fd: int | None = None
        self._size = 0  # bytes in the file
        self._pending: list[tuple[dict[str, Any], Any, Any]] = []
        self._shrunk: dict[int, tuple[Any, int]] = {}  # block -> the rows it did not get, dim
        self.broken: str | None = None  # why counting stopped (never the job)
        self._handles: list[Any] = []  # every hook of ours (remove() takes them off)

    def install(self) -> None:
        import sys  # torch.optim's submodule is not an attribute of the package
        import warnings

        mod = self.torch.nn.modules.module
        self._global = mod.register_module_forward_pre_hook(self._look)
        self._handles.append(self._global)
        # torch.compile(model) warns of global hooks: ours, harmless there, not the job's
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when "
                                "there are global hooks")
        optim = sys.modules.get("torch.optim.optimizer")
        if optim is not None:  # without it steps are not told apart: every call is step 0
            self._handles.append(optim.register_optimizer_step_post_hook(self._stepped))
        self._open(truncate=True)

    def remove(self) -> None:
        """Every hook of ours off and the file closed (a reference runs plan after plan)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._global = [], None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _look(self, module: Any, args: Any) -> Any:
        """Every module call until the first step: an MoE block (or a named router)?"""
        if self._compiling():
            return None
        key = id(module)
        if key in self._looked:
            return
        self._looked.add(key)
        if len(self._roots) < _MAX_ROOTS:
            self._roots.append(module)
        with contextlib.suppress(Exception):
            if self._classify(module):
                # the block's own pre-hooks of this call were taken before we added ours
                cut = self._shrink(module, args, {})
                return None if cut is None else cut[0]
        return None

    def _classify(self, module: Any) -> bool:
        """Hook ``module`` if it is a router or an MoE block; True: a block a plan cuts."""
        nn = self.torch.nn
        if self.router_class is not None:
            names = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
            if self.router_class in names:
                self._add(module, module, (module,))
            return False
        experts = module._modules.get("experts")
        if not isinstance(experts, nn.Module):
            return False
        for attr in _ROUTER_ATTRS:
            router = module._modules.get(attr)
            if isinstance(router, nn.Module) and id(router) not in self._routers:
                n = len(experts) if isinstance(experts, nn.ModuleList) else None
                self._add(router, module, (module, router, experts,
                                           getattr(module, "config", None)), n)
                # 3-D weights [E, ...] anywhere in it (a LoRA wrapper holds them below)
                self._routers[id(router)].fused = n is None and any(
                    p.dim() >= 3 for p in experts.parameters())
                if self.plan is not None and self.plan.keep is not None:
                    self._handles += [
                        module.register_forward_pre_hook(self._shrink, with_kwargs=True),
                        module.register_forward_hook(self._regrow)]
                    return True
                return False
        return False

    def _add(self, router: Any, owner: Any, where: tuple[Any, ...],
             n: int | None = None) -> None:
        self._routers[id(router)] = _Router(
            None, owner, n or _int_attr(where, _COUNT_ATTRS), _int_attr(where, _TOPK_ATTRS))
        self._handles.append(router.register_forward_hook(self._routed))

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # the first optimizer to step counts the steps (a job with several steps each)
        if self._opt is None:
            self._opt = id(optimizer)
        if id(optimizer) != self._opt:
            return
        with contextlib.suppress(Exception):
            self.drain()
        self.step += 1
        for r in self._routers.values():
            r.calls = 0
        if self._global is not None:  # every router has run by now
            if not self._routers and self._dynamo_compiled():
                # no router seen, and torch.compile traced code: inside its graphs nothing
                # of ours ran (see _compiling), so say that, not "no router"
                with contextlib.suppress(Exception):
                    self._write({"compiled": True, "step": self.step - 1})
            self._global.remove()
            self._global, self._roots, self._names = None, [], {}
            self._looked = set()
        self._previous, self._current = self._current, []
        if self._size > MAX_BYTES:  # bounded: the last complete step (and the plan's) kept
            with contextlib.suppress(OSError):
                self._rewrite()

    def _routed(self, router: Any, args: Any, out: Any) -> Any:
        if self.broken is not None or self._compiling():
            return None
        info = self._routers.get(id(router))
        if info is None:
            return None
        try:
            if info.block is None:
                info.block = self._name(info.owner)
            new, idx, top_k = self._route(info, out)
            counts = self.torch.bincount(idx.reshape(-1).long(),
                                         minlength=info.experts or 0)
            rec = {"step": self.step, "block": info.block, "call": info.calls,
                   "tokens": int(idx.shape[0]), "experts": int(counts.numel()),
                   "top_k": top_k, "plan": new is not None or self._planned_here(info)}
            if info.fused:
                rec["fused"] = True
            info.calls += 1
            self._count(rec, counts)
            return new
        except Exception as exc:  # never the job's problem: counting stops, the job goes on
            self.broken = f"{type(exc).__name__}: {exc}"[:200]
            return None

    def _route(self, info: _Router, out: Any) -> tuple[Any, Any, int | None]:
        """(the output the plan makes or None, the top-k indices [tokens, k], k)."""
        torch = self.torch
        # a keep plan cut the block's input already (_shrink): the router routes what is left
        planned = self._planned_here(info) and self.plan is not None and self.plan.keep is None
        if torch.is_tensor(out) and out.is_floating_point():
            new = self._rebias(out) if planned else None
            logits = (out if new is None else new).detach().reshape(-1, out.shape[-1])
            k = min(info.top_k or 1, logits.shape[-1])
            # the choice as softmax-top-k routers make it (Mixtral, Qwen-MoE: softmax in
            # float32, then top-k), ties included: top-k of raw logits can differ where the
            # softmax underflows to equal zeros
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            return new, probs.topk(k, dim=-1).indices, k
        if not isinstance(out, (tuple, list)):
            raise TypeError(f"router output {type(out).__name__}: neither logits nor indices")
        # a router that chose already: its top-k indices are its one integer tensor of 2 dims
        pos = next(i for i, t in enumerate(out) if torch.is_tensor(t) and t.dim() == 2
                   and not t.is_floating_point())
        idx = out[pos]
        if not planned:
            return None, idx, int(idx.shape[-1])
        assert self.plan is not None
        idx = self._reroute(idx, info.experts or int(idx.max()) + 1)
        items = list(out)
        items[pos] = idx
        return type(out)(items) if type(out) in (tuple, list) else tuple(items), idx, \
            int(idx.shape[-1])

    def _compiling(self) -> bool:
        """Tracing for torch.compile: nothing of ours (traced, the hooks broke a model into 7
        graphs). A compiled model's routers go uncounted."""
        is_compiling = getattr(getattr(self.torch, "compiler", None), "is_compiling", None)
        return bool(is_compiling()) if is_compiling is not None else False

    def _dynamo_compiled(self) -> bool:
        """torch.compile has compiled a frame of this process (dynamo's own counters)."""
        utils = sys.modules.get("torch._dynamo.utils")
        counters = getattr(utils, "counters", None)
        return bool(counters is not None and counters["frames"]["ok"])

    def _planned_here(self, info: _Router) -> bool:
        return self.plan is not None and self.plan.applies(self.rank, self.step,
                                                           info.block or "")

    def _shrink(self, block: Any, args: Any, kwargs: Any) -> Any:
        """A ``keep`` plan: the block gets the first tokens of its input only (the token dim:
        the second-to-last of its first argument, [T, D] or [B, S, D])."""
        plan = self.plan
        x: Any = args[0] if args else None
        if plan is None or plan.keep is None or not self.torch.is_tensor(x) or x.dim() < 2 \
                or not plan.applies(self.rank, self.step, self._block_name(block)):
            return None
        kept, rest, dim = routeplan.shrink(x, plan.keep)
        self._shrunk[id(block)] = (rest, dim)
        return (kept, *args[1:]), kwargs

    def _regrow(self, block: Any, args: Any, out: Any) -> Any:
        rest, dim = self._shrunk.pop(id(block), (None, 0))
        return None if rest is None else routeplan.regrow(self.torch, out, rest, dim)

    def _block_name(self, block: Any) -> str:
        info = next((r for r in self._routers.values() if r.owner is block), None)
        if info is None:
            return ""
        if info.block is None:
            info.block = self._name(block)
        return info.block

    def _rebias(self, out: Any) -> Any:
        assert self.plan is not None
        return routeplan.rebias(self.plan, out)

    def _reroute(self, idx: Any, n: int) -> Any:
        assert self.plan is not None
        return routeplan.reroute(self.torch, self.plan, idx, n)

    def _name(self, owner: Any) -> str:
        for root in self._roots:
            names = self._names.get(id(root))
            if names is None:
                names = {id(m): n for n, m in root.named_modules()}
                self._names[id(root)] = names
            if id(owner) in names and names[id(owner)]:
                return _strip(names[id(owner)])
        # the model itself: its class, not the subclass FSDP2 made of it (FSDPMixtral)
        cls = next((c for c in type(owner).__mro__
                    if not c.__module__.startswith("torch.distributed")), type(owner))
        return cls.__name__

    def _open(self, truncate: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.path, flags, 0o600)

    def _count(self, rec: dict[str, Any], counts: Any) -> None:
        """On the CPU at once; a GPU's counts are copied without a sync and written once the
        copy is done (:meth:`drain`): a ``.tolist()`` there would stall every router call."""
        if counts.device.type == "cpu":
            rec["counts"] = counts.tolist()
            self._write(rec)
            return
        host = counts.to("cpu", non_blocking=True)
        done = self.torch.cuda.Event()
        done.record()
        self._pending.append((rec, host, done))
        self.drain()

    def drain(self) -> None:
        """The GPU counts whose copy finished (never waits: a hung stream keeps its own)."""
        while self._pending and self._pending[0][2].query():
            rec, host, _ = self._pending.pop(0)
            rec["counts"] = host.tolist()
            self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        (self._planned if rec.get("plan") else self._current).append(line)
        if self._fd is not None:
            os.write(self._fd, line)
            self._size += len(line)

    def _rewrite(self) -> None:
        """The plan's calls and the step just completed; the new step's calls follow."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        kept = b"".join(self._planned + self._previous)
        try:
            os.write(fd, kept)
        finally:
            os.close(fd)
        self._size = len(kept)
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
        self._open()


def install(torch: Any, rank: int, path: Path, env: dict[str, str]) -> Routing | None:
    """Counting (and the plan) in this rank, unless ``MOE_HANG_ROUTING=0``."""
    if env.get(ENV_OFF, "1") in ("", "0"):
        return None
    routing = Routing(torch, rank, path, Plan.from_env(env), env.get(ENV_ROUTER) or None)
    routing.install()
    return routing
