"""Ground truth of the accuracy corpus: one typed record per case.

Each case names a job in ``tests/corpus/jobs/`` (plain torch.distributed, launched by real
torchrun, gloo), how it is run and what a careful human concludes about it: the verdict, the
culprit ranks, the line each rank is at, advice that would be wrong, and optionally what the
summary must say. Ground truth is what the job does, read from its code (and, where that was
not enough, from its log and stacks), never what the tool prints.

Roles come from environment variables (``CULPRIT_RANK=1``, ...), and every expectation that
names a rank is a function of that environment, so a case's mirrored twin (the roles swapped
through ``mirror``) is checked against the swapped ranks.

How a case runs (``mode``):

- ``watch``: ``moe-hang watch --json --out DIR [--stall S] -- torchrun --nproc_per_node N
  --master_addr 127.0.0.1 --master_port FREE job.py``; the verdict is what watch printed.
- ``diagnose``: torchrun is started in the background in its own session; once ``marks``
  ranks wrote ``$JOB_MARKS/<wait_mark>.rank<r>`` and ``settle_s`` passed, ``moe-hang diagnose
  <torchrun pid> --json --out DIR`` runs; then every process of the job is killed.
- ``analyze``: plain torchrun, no moe-hang in the job; every rank whose recorder stands still
  with a collective pending writes torch's own dumps (``jobs/_frdump``, as NCCL's watchdog
  does at its timeout; a rank gloo aborted writes none); then ``moe-hang analyze --json
  <dumps>/<form>`` (``form``: ``pickle``, with frames, or ``json``).

Where a call site is checked (``LineExpect.where``):

- ``rank``: ``ranks[r].callsite`` (where rank r is now, or was when it died/raised);
- ``divergence``: ``first_divergence.per_rank[r].callsite`` (the line that posted the rank's
  collective at the first divergence); its absence is a miss;
- ``divergence?``: ``first_divergence.per_rank[r].callsite`` where the diagnosis has an entry
  for rank r (a rank that never posted the collective may have none);
- ``rank+divergence``: ``ranks[r].callsite``, and ``first_divergence.per_rank[r].callsite``
  where the diagnosis has one for that rank.

``no_lines``: the evidence holds no line (torch's JSON dumps carry no frames): the verdict
must claim none.

``basis``: the rungs that may decide. ``history`` (the agreed earlier steps) is the first rung:
a job that hangs after one or more whole steps is decided there wherever those steps show the
culprit's break; the weaker rungs a case lists are the ones that would decide without them.

``culprit_basis`` / ``certainty`` may be absent from today's JSON: an expectation on them is
"not checked yet" while the field is absent, unless the case sets ``require_basis`` (or the
runner runs with ``--require-basis``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Env = Mapping[str, str]
RankFn = Callable[[Env], frozenset[int]]

# verdicts that are not a problem (exit 0): a straggler is slow, not stuck
HEALTHY = frozenset({"healthy", "straggler"})
# a rank stuck outside any collective: today's schema calls it a hang; the engine being
# rewritten may name it (the "stalled outside collectives")
STALLED = frozenset({"hang", "stalled", "stalled_outside_collectives"})
# a wait-for cycle: a hang, or a verdict of its own
DEADLOCK = frozenset({"hang", "deadlock"})
DESYNC = frozenset({"desync"})
DESYNC_OR_HANG = frozenset({"desync", "hang", "deadlock"})

# advice that is wrong for the case at hand (case-insensitive substrings of ``fix``)
SKIP_ADVICE = ("skip a layer", "skip an expert", "expert or exchange", "dummy input")
TRANSPORT_ADVICE = ("NCCL_DEBUG", "suspect the transport")
VARLEN_ADVICE = ("varlen", "VarlenDispatch", "DTensor.from_local", "3631")
DTYPE_ADVICE = ("cast to one dtype",)
ANCHOR_ADVICE = ("anchor",)
# an exception, a dead rank or a stuck loader is none of the collective-order bugs
NOT_A_COLLECTIVE_BUG = SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE


@dataclass(frozen=True)
class Site:
    """A line: ``marker`` names a ``# corpus: <marker>`` comment in the job; otherwise the
    first line of ``module``'s source file that contains ``needle`` (third-party code)."""

    marker: str | None = None
    module: str | None = None
    needle: str | None = None


@dataclass(frozen=True)
class LineExpect:
    ranks: RankFn
    site: Site
    where: str = "rank"  # rank | divergence | divergence? | rank+divergence


@dataclass(frozen=True)
class Case:
    name: str
    job: str  # a file of tests/corpus/jobs/, or an absolute path (a generated job)
    nproc: int
    verdicts: frozenset[str]
    mode: str = "watch"  # watch | diagnose | analyze
    form: str = "pickle"  # analyze: which of torch's dumps (pickle, with frames, or json)
    env: Mapping[str, str] = field(default_factory=dict)
    # the env overrides of the mirrored twin (roles swapped); None: no twin
    mirror: Mapping[str, str] | None = None
    culprits: RankFn = lambda env: frozenset()
    culprits_check: bool = True
    lines: tuple[LineExpect, ...] = ()
    # the evidence holds no line (dumps without frames): the verdict must claim none
    no_lines: bool = False
    fix_forbid: tuple[str, ...] = ()
    fix_require: tuple[str, ...] = ()
    # a healthy job: no advice at all with a healthy verdict (a straggler's may point at the
    # slow rank; fix_forbid still applies)
    fix_none: bool = False
    summary_contains: str | None = None
    basis: frozenset[str] = frozenset()
    certainty: frozenset[str] = frozenset()
    require_basis: bool = False
    fast: bool = False
    stall: float | None = None  # watch --stall (None: the tool's default)
    # more watch options: a rank stuck outside collectives for ever is uncertain (it may be
    # slow) until --hang-after (300 s by default): these cases wait less
    watch_opts: tuple[str, ...] = ()
    timeout_s: float = 120.0  # hard limit of the whole run
    # watch: nnodes > 1 runs nnodes torchrun agents (c10d rendezvous, nproc/nnodes ranks
    # each), each under its own watch, as srun starts them; every watcher's diagnosis is
    # scored, and a field is right only when it is right on every node
    nnodes: int = 1
    requires: tuple[str, ...] = ()  # importable modules the job needs (else skipped)
    # directories (relative to the repository root) put in front of the job's PYTHONPATH,
    # and searched first for ``requires`` and for a Site's module: a release of a package
    # that cannot be installed beside the others (``make corpus`` unpacks them there)
    pythonpath: tuple[str, ...] = ()
    install_hint: str = ""  # what installs ``requires`` (said when the case is skipped)
    wait_mark: str = "hang"  # diagnose: the mark to wait for ...
    marks: int | None = None  # ... from this many ranks (default: all)
    settle_s: float = 2.0  # diagnose: then this long before attaching
    note: str = ""


@dataclass(frozen=True)
class Expected:
    """A case's expectations evaluated for one role environment."""

    verdicts: frozenset[str]
    culprits: frozenset[int]
    culprits_check: bool
    lines: tuple[LineExpect, ...]
    fix_forbid: tuple[str, ...]
    fix_require: tuple[str, ...]
    summary_contains: str | None
    basis: frozenset[str]
    certainty: frozenset[str]
    fix_none: bool = False
    no_lines: bool = False


def expected_for(case: Case, env: Env) -> Expected:
    return Expected(case.verdicts, frozenset(case.culprits(env)), case.culprits_check,
                    case.lines, case.fix_forbid, case.fix_require, case.summary_contains,
                    case.basis, case.certainty, case.fix_none, case.no_lines)


# --- roles ---------------------------------------------------------------------------------

def rank(var: str) -> RankFn:
    """The rank in $var (every case sets its role variables explicitly)."""
    return lambda env: frozenset({int(env[var])})


def ranks(var: str) -> RankFn:
    """The ranks in a comma-separated $var (empty: none)."""
    return lambda env: frozenset(int(r) for r in env[var].split(",") if r.strip())


def others(fn: RankFn, nproc: int) -> RankFn:
    return lambda env: frozenset(range(nproc)) - fn(env)


def every(nproc: int) -> RankFn:
    return lambda env: frozenset(range(nproc))


def fixed(*rs: int) -> RankFn:
    return lambda env: frozenset(rs)


def at(who: RankFn, marker: str, where: str = "rank") -> LineExpect:
    return LineExpect(who, Site(marker=marker), where)


C = rank("CULPRIT_RANK")


def culprit_env(r: int) -> dict[str, str]:
    return {"CULPRIT_RANK": str(r)}


# advice that answers a missing collective ("make rank 1 post ... too")
POST_TOO = ("post that too", "too: it went on")
# advice about experts, for a job that has none
EXPERT_ADVICE = ("expert",)

# NeMo Automodel releases, each unpacked on its own (``pip install --no-deps --target``) by
# ``make corpus``: 0.5.0 pins transformers 5, which the transformers cases cannot share a venv
# with, and 0.5.0 and 0.7.0 cannot share one either
AUTOMODEL_UNFIXED = ".venv/corpus/nemo-automodel-0.5.0"
AUTOMODEL_FIXED = ".venv/corpus/nemo-automodel-0.7.0"
AUTOMODEL_HINT = "make corpus installs it"
# 0.5.0's token gather (the naive one: lora_experts.py:184)
AUTOMODEL_GATHER = Site(module="nemo_automodel.components._peft.lora_experts",
                        needle="x = DTensor.from_local(x, device_mesh=ep_mesh")

MIXTRAL_LOOP = Site(module="transformers.models.mixtral.modeling_mixtral",
                    needle="current_hidden_states = expert_layer(current_state)")


# --- the cases -------------------------------------------------------------------------------

CASES: tuple[Case, ...] = (
    # 1. an exception in one rank
    Case("raise_in_rank", "raise_in_rank.py", 2, frozenset({"crash"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "raise"), at(others(C, 2), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE, summary_contains="ValueError",
         basis=frozenset({"exception"}), certainty=frozenset({"definite"}), fast=True,
         note="rank C raises ValueError at step 2; the others wait in step 2's all-reduce and "
              "then fail with gloo's 'Connection closed by peer'"),
    Case("oom_exception", "oom_exception.py", 4, frozenset({"crash"}),
         env=culprit_env(2), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "raise"), at(others(C, 4), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE, summary_contains="OutOfMemoryError",
         basis=frozenset({"exception"}), certainty=frozenset({"definite"}), timeout_s=150,
         note="4 ranks; rank C raises torch.OutOfMemoryError; three victims fail after it"),
    # 2. DDP without find_unused_parameters
    Case("ddp_unused_param", "ddp_unused_param.py", 2, frozenset({"crash"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "forward"), at(others(C, 2), "backward")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         summary_contains="Expected to have finished reduction",
         basis=frozenset({"exception"}),
         note="rank C skipped `refine` at step 2; its step-3 forward raises DDP's 'Expected to "
              "have finished reduction' (traceback: the model(x) line); the other rank waited "
              "in step 2's backward bucket all-reduce, then gloo closed it"),
    Case("ddp_healthy", "ddp_healthy.py", 2, frozenset({"healthy"})),
    # 3. healthy jobs: fast, slow, idle for a while
    Case("healthy_fast", "healthy_fast.py", 2, frozenset({"healthy"}), fast=True),
    Case("healthy_slow", "healthy_slow.py", 2, frozenset({"healthy"}),
         note="~1 s of compute per step on every rank, 12 steps"),
    Case("healthy_idle", "healthy_idle.py", 2, frozenset({"healthy"}),
         env=culprit_env(0), mirror=culprit_env(1),
         note="rank C sleeps 12 s once (a slow checkpoint write) while the other waits in the "
              "all-reduce; with watch's default stall the job must run to completion"),
    Case("healthy_steady_attach", "healthy_steady.py", 2, frozenset({"healthy"}),
         mode="diagnose", note="diagnose attached to a job that is stepping normally"),
    # 4. a rank blocked outside collectives
    Case("dataloader_sleep", "dataloader_sleep.py", 2, STALLED,
         watch_opts=("--hang-after", "20"),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "sleep"), at(others(C, 2), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE, timeout_s=180,
         note="rank C's data loader loops in time.sleep for ever; the other waits in the "
              "all-reduce: the problem is outside the collectives, not in the transport"),
    Case("dataloader_sleep_attach", "dataloader_sleep.py", 2, STALLED, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "sleep"), at(others(C, 2), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE),
    # issue 28: a rank's work includes its helper processes
    Case("dataloader_worker_busy_attach", "dataloader_worker_busy.py", 2, HEALTHY,
         mode="diagnose", env={**culprit_env(1), "BUSY_S": "60"}, mirror=culprit_env(0),
         culprits=C,
         note="rank C's DataLoader worker decodes one sample for a minute (bounded; the "
              "runner kills the job) while its main thread waits on the loader's queue and "
              "the other rank waits in the all-reduce: the rank is working through its "
              "helper, a straggler at most, never a hang"),
    Case("async_wait_skip_attach", "async_wait_skip.py", 2, DESYNC, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier"), at(others(C, 2), "post")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE + VARLEN_ADVICE,
         fix_require=("does not take",), basis=frozenset({"source", "program_order"}),
         note="stacks alone: the other rank's main thread is at `work.wait()`, no collective "
              "call; the source links the handle to the all-reduce that posted it (its line "
              "is the rank's), under a branch that leaves rank C out"),
    Case("async_skip_then_eval_attach", "async_skip_then_eval.py", 2, STALLED,
         mode="diagnose", marks=1, env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "eval"), at(others(C, 2), "wait")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE, fix_require=("fewer of the loop",),
         basis=frozenset({"program_order"}),
         note="written for the occasion: stacks alone, no recorder; rank C skipped one async "
              "all-reduce and idles after the loop at module level, the other waits inside "
              "it: nothing brings rank C back to the loop"),
    Case("async_wait_skip", "async_wait_skip.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier"), at(others(C, 2), "post")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE + VARLEN_ADVICE,
         note="the same under watch: the recorder holds the posts"),
    Case("async_sync_helper", "async_sync_helper.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier"), at(others(C, 2), "post_b")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE + VARLEN_ADVICE,
         note="two collectives in flight each step, waited in a synchronize() helper: the "
              "recorder holds the posts, so the other rank's line is the bucket it posted "
              "and rank C did not"),
    Case("async_sync_helper_attach", "async_sync_helper.py", 2, DESYNC_OR_HANG,
         mode="diagnose", env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier"),),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE + VARLEN_ADVICE,
         note="stacks alone: the other rank's main thread is in the helper's work.wait(), "
              "two posts behind it and no handle named at either: which collective it waits "
              "on is not in the evidence; the verdict must not invent a line for it"),
    Case("dataloader_worker_stuck_attach", "dataloader_worker_busy.py", 2, STALLED,
         mode="diagnose", env={**culprit_env(1), "STUCK": "1"}, mirror=culprit_env(0),
         culprits=C, lines=(at(others(C, 2), "allreduce"),),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE,
         summary_contains="DataLoader worker",
         note="rank C's DataLoader worker blocks on a lock no one releases: its main thread "
              "waits on the loader for ever, the other in the all-reduce: a hang, rank C, "
              "named with where its worker is stuck"),
    Case("monitored_barrier_timeout", "monitored_barrier_timeout.py", 2,
         STALLED | {"crash"}, watch_opts=("--hang-after", "20"), env=culprit_env(1),
         mirror=culprit_env(0), culprits=C,
         lines=(at(C, "sleep"), at(others(C, 2), "barrier")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE,
         note="rank 0's monitored_barrier raises after 5 s naming rank C, which is stuck in "
              "its data loader (time.sleep); the rank that raised is the victim"),
    # 5. size mismatch
    Case("size_mismatch", "size_mismatch.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(every(2), "allreduce", "rank+divergence"),),
         fix_forbid=VARLEN_ADVICE + ANCHOR_ADVICE + DTYPE_ADVICE,
         basis=frozenset({"history"}), fast=True,
         note="16 vs 32 elements on two ranks at step 3: one against one, but every earlier "
              "step all-reduced 16 on both, so the rank that posted 32 broke the shape every "
              "rank had kept (issue 18, case 4)"),
    Case("size_mismatch_majority", "size_mismatch_majority.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(every(3), "allreduce", "rank+divergence"),),
         fix_forbid=VARLEN_ADVICE + ANCHOR_ADVICE + DTYPE_ADVICE,
         basis=frozenset({"history"}),
         note="three ranks: two post 16 elements, rank C 32: the odd one out — and every "
              "earlier step all-reduced 16 on all three, the rung above the count of ranks "
              "(the one ladder, as for two ranks)"),
    Case("dtype_mismatch", "dtype_mismatch.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(every(3), "allreduce", "rank+divergence"),),
         fix_forbid=VARLEN_ADVICE + ANCHOR_ADVICE + SKIP_ADVICE,
         basis=frozenset({"history"}),
         note="three ranks: float32, float32, float64 (rank C), 16 elements each; every "
              "earlier step was float32 on all three (history, above the majority)"),
    # 6. stale all-to-all split counts
    Case("stale_a2a_counts", "stale_a2a_counts.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "tokens", "rank+divergence"),
                at(others(C, 2), "counts", "rank+divergence")),
         fix_forbid=DTYPE_ADVICE + VARLEN_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"program_order", "history"}), fast=True,
         note="rank C skipped the count exchange (int64 all_to_all) and is in the token "
              "all_to_all (float32): the dtypes differ because the collectives differ"),
    # 7. a 2×2 mesh, the wrong group on two ranks
    Case("mesh_wrong_group", "mesh_wrong_group.py", 4, DESYNC_OR_HANG,
         env={"WRONG_GROUP_RANKS": "2,3"}, mirror={"WRONG_GROUP_RANKS": "0,1"},
         culprits=ranks("WRONG_GROUP_RANKS"),
         lines=(at(ranks("WRONG_GROUP_RANKS"), "loss"),
                at(others(ranks("WRONG_GROUP_RANKS"), 4), "gather")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"program_order", "history"}), timeout_s=150,
         note="the wrong-group ranks gathered over tp (it completed between them) and wait "
              "in the loss all-reduce; the others wait in the ep gather for them. The "
              "default group's 'missing' ranks (the victims) are a consequence"),
    # 8. transformers MoE + peft LoRA + FSDP2 per expert
    Case("hf_moe_lora_fsdp_skip", "hf_moe_lora_fsdp_skip.py", 2, DESYNC_OR_HANG,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(LineExpect(others(C, 2), MIXTRAL_LOOP, "divergence"),
                LineExpect(C, MIXTRAL_LOOP, "divergence?")),
         fix_forbid=ANCHOR_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"program_order", "history"}), requires=("transformers", "peft"),
         timeout_s=180,
         note="rank C routed no token to layer 1's expert 2 at step 2, so Mixtral's "
              "expert_hit loop did not call it and its FSDP all-gather was never posted; the "
              "first divergence is in that loop on both ranks (expert 2's all-gather on the "
              "others, expert 3's on rank C: same shapes, so it pairs silently; the exact "
              "seq cannot be known from sizes, the line can: every forward expert all-gather "
              "is posted there). Rank C may be listed as missing there. Where the ranks end "
              "up (backward, a few collectives later) is not checked"),
    Case("hf_moe_lora_fsdp_healthy", "hf_moe_lora_fsdp_healthy.py", 2, frozenset({"healthy"}),
         requires=("transformers", "peft"), timeout_s=180),
    # 9. a wait-for cycle of recvs
    Case("recv_recv_deadlock", "recv_recv_deadlock.py", 2, DEADLOCK, culprits=every(2),
         lines=(at(every(2), "recv"),),
         fix_forbid=NOT_A_COLLECTIVE_BUG, basis=frozenset({"cycle"}),
         note="both pipeline stages posted recv before send: each waits for the other"),
    Case("recv_recv_deadlock_attach", "recv_recv_deadlock.py", 2, DEADLOCK, mode="diagnose",
         culprits=every(2), lines=(at(every(2), "recv"),),
         fix_forbid=NOT_A_COLLECTIVE_BUG, basis=frozenset({"cycle"})),
    # cross-group order inversion
    Case("group_order_inversion", "group_order_inversion.py", 2, DESYNC_OR_HANG,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "ep_first"), at(others(C, 2), "dp_first")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history", "program_order"}),
         note="steps 0-2 reduce dp then ep on every rank; at step 3 rank C does ep first: by "
              "history it is the one that changed order"),
    # a rank with no local experts skips an init-time broadcast
    Case("no_local_experts_broadcast", "no_local_experts_broadcast.py", 3, DESYNC_OR_HANG,
         env=culprit_env(2), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "allreduce"),),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"majority", "program_order"}),
         note="rank C skipped rank 0's four expert broadcasts and is in the first training "
              "all-reduce"),
    # a rank finished its data early and exited cleanly
    Case("early_finish", "early_finish.py", 2, frozenset({"rank_died"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(others(C, 2), "allreduce"),),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"exited"}), fast=True,
         note="rank C ran out of data and exited normally; the others wait in the next "
              "all-reduce and are then failed by gloo ('Connection closed by peer')"),
    # SIGKILL (OOM killer)
    Case("sigkill_rank", "sigkill_rank.py", 2, frozenset({"rank_died"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(others(C, 2), "allreduce"),),
         fix_forbid=NOT_A_COLLECTIVE_BUG, summary_contains="SIGKILL",
         basis=frozenset({"exited"}), certainty=frozenset({"definite"}), fast=True),
    # a straggler: slow, not stuck
    Case("straggler", "straggler.py", 2, HEALTHY,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C, stall=2.0,
         note="rank C computes ~8 s at step 2 while the other waits (watch --stall 2): "
              "healthy or straggler, never a hang; exit 0"),
    Case("straggler_attach", "straggler.py", 2, HEALTHY, mode="diagnose",
         env={**culprit_env(1), "STRAGGLE_S": "60"},
         mirror=culprit_env(0), culprits=C,
         note="diagnose while rank C computes (bounded at 60 s; the runner kills the job)"),
    # subgroup desync
    Case("subgroup_desync", "subgroup_desync.py", 4, DESYNC_OR_HANG,
         env=culprit_env(3), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "barrier"),
                LineExpect(lambda env: frozenset({int(env["CULPRIT_RANK"]) ^ 1}),
                           Site(marker="group_allreduce"), "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history", "program_order", "source"}), timeout_s=150,
         note="rank C skipped its pair's all-reduce and is in the global barrier with the "
              "other pair; its partner waits in the pair all-reduce. The default group's "
              "majority (three ranks in the barrier) points at the partner: wrong. The "
              "all-reduce runs under `if not (rank == skipper and step == 2)` and every "
              "earlier step posted it: the source decides too"),
    # a short process-group timeout
    Case("pg_timeout_skip", "pg_timeout_skip.py", 3, DESYNC_OR_HANG | {"crash"},
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "allgather"), at(others(C, 3), "allreduce")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"history", "majority", "program_order"}),
         note="5 s timeout; rank C skipped the default-group all-reduce and waits in the "
              "expert-group all-gather; everyone times out and raises; the culprit is still "
              "rank C, not the ranks whose timeouts fired"),
    # recv of a tensor never sent
    Case("recv_never_sent", "recv_never_sent.py", 2, DESYNC_OR_HANG,
         env={**culprit_env(1), "RECEIVER_RANK": "0"},
         mirror={**culprit_env(0), "RECEIVER_RANK": "1"}, culprits=C,
         lines=(at(C, "allreduce"), at(rank("RECEIVER_RANK"), "recv")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"program_order"}),
         note="the receiver waits in recv; the sender (rank C) skipped its send and is in the "
              "all-reduce that follows it"),
    Case("recv_never_sent_spin", "recv_never_sent.py", 2, DESYNC_OR_HANG,
         env={**culprit_env(1), "RECEIVER_RANK": "0", "SPIN_THREAD": "1"},
         mirror={**culprit_env(0), "RECEIVER_RANK": "1"}, culprits=C,
         lines=(at(C, "allreduce"), at(rank("RECEIVER_RANK"), "recv")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"program_order"}),
         note="as recv_never_sent, and every rank has a thread burning a core in native code "
              "(a CUDA spin-wait): a busy process is not a progressing rank"),
    Case("recv_never_sent_spin_attach", "recv_never_sent.py", 2, DESYNC_OR_HANG,
         mode="diagnose",
         env={**culprit_env(1), "RECEIVER_RANK": "0", "SPIN_THREAD": "1"},
         mirror={**culprit_env(0), "RECEIVER_RANK": "1"}, culprits=C,
         lines=(at(C, "allreduce"), at(rank("RECEIVER_RANK"), "recv")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE),
    # op mismatch: all_gather vs barrier
    Case("op_mismatch", "op_mismatch.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier", "rank+divergence"),
                at(others(C, 2), "allgather", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         # every earlier step posted the all-gather before the barrier; the barrier comes
         # after it in the source; `if not (rank == culprit and ...)` names the rank that
         # skips it: any of the three is the truth
         basis=frozenset({"history", "program_order", "source"}), fast=True),
    Case("op_mismatch_attach", "op_mismatch.py", 2, DESYNC, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier"), at(others(C, 2), "allgather")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"source"}),
         note="stacks only (no recorder, and py-spy shows no counter of a module-level "
              "loop): the two lines are one iteration apart or a lap, as many collectives "
              "skipped either way; the all-gather runs under `if not (rank == culprit and "
              "...)`, a branch that leaves ranks out, the barrier under none: the rank in "
              "the barrier is the one left out"),
    Case("early_return_barrier", "early_return_barrier.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier", "rank+divergence"),
                at(others(C, 2), "allreduce", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"history", "program_order"})),
    Case("rank0_eval_collective", "rank0_eval_collective.py", 3, DESYNC,
         env=culprit_env(0), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "eval_allreduce", "rank+divergence"),
                at(others(C, 3), "allreduce", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"history", "majority"}),
         note="only rank C evaluates, and evaluate() all-reduces 2 elements; the other two "
              "are in the next step's 32-element all-reduce"),
    Case("ddp_uneven_batches", "ddp_uneven_batches.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "val_allreduce"), at(others(C, 2), "backward")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         fix_require=("left the loop",), basis=frozenset({"history", "program_order"}),
         note="written for the occasion (DDP's uneven inputs): rank C ran one batch fewer; "
              "it is past the loop in the validation all-reduce while the other waits in "
              "DDP's backward all-reduce"),
    # a backward collective skipped on one rank
    Case("backward_skip", "backward_skip.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "loss", "rank+divergence"),
                at(others(C, 2), "bwd_allreduce", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"history", "program_order"}),
         note="rank C's output ignores the gathered tokens, so autograd skips the Function's "
              "backward all-reduce there; it is in the loss all-reduce"),
    # FSDP2 + DTensor, a submodule skipped
    Case("fsdp2_skip_submodule", "fsdp2_skip_submodule.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         # the others receive less than they expect at the divergence: gloo lets them on, and
         # they die at the head's all-gather; the line they posted the refine one from is fixed
         lines=(at(C, "head", "rank+divergence"),
                at(others(C, 2), "refine", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"history", "program_order"}),
         note="rank C skipped refine: its head all-gather (shard of 68) meets the others' "
              "refine all-gather (272); gloo aborts one of them"),
    # the ragged DTensor gather, where the varlen fix IS the answer
    # issue 18, case 1: NeMo Automodel's own GroupedExpertsLoRA, unfixed (0.5.0) and fixed
    Case("automodel_lora_experts", "automodel_lora_experts.py", 2, DESYNC,
         env={"RAGGED_TOKENS": "68,401"}, mirror={"RAGGED_TOKENS": "401,68"},
         culprits=every(2),
         # the rank with more rows receives fewer bytes than its buffer: gloo lets it on to
         # the routing-weights gather (:187); the other aborts (SIGABRT) at :184
         lines=(LineExpect(every(2), AUTOMODEL_GATHER, "divergence"),),
         fix_require=("varlen",),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + TRANSPORT_ADVICE + POST_TOO,
         summary_contains="51328", basis=frozenset({"ambiguous"}),
         requires=("nemo_automodel",), pythonpath=(AUTOMODEL_UNFIXED,),
         install_hint=AUTOMODEL_HINT, timeout_s=180,
         note="nemo-automodel 0.5.0, 2 ranks of an ep mesh, two balanced steps (64 tokens "
              "each) then 68 and 401 tokens: both ranks post the token all-gather at "
              "lora_experts.py:184 with different row counts (a size mismatch; gloo's abort "
              "prints 51328 vs 8704 bytes). Both ranks run the same code and both sizes "
              "differ from every earlier step's: the evidence does not decide between "
              "them. The fix is the varlen exchange (PR #3631)"),
    Case("automodel_lora_experts_fixed", "automodel_lora_experts.py", 2,
         frozenset({"healthy"}), env={"RAGGED_TOKENS": "68,401"},
         requires=("nemo_automodel",), pythonpath=(AUTOMODEL_FIXED,),
         install_hint=AUTOMODEL_HINT, timeout_s=180,
         note="the same job on nemo-automodel 0.7.0 (PR #3631: lengths exchanged, padded "
              "gather, ragged all-reduce combine): every step completes, exit 0"),
    # issue 18, case 2: FSDP2 without experts, an evaluation forward on one rank only
    Case("fsdp2_rank0_eval", "fsdp2_rank0_eval.py", 2, DESYNC,
         env=culprit_env(0), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "eval_forward", "divergence"), at(others(C, 2), "backward")),
         fix_require=("evaluate",),
         fix_forbid=EXPERT_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE
         + TRANSPORT_ADVICE,
         basis=frozenset({"program_order", "history", "majority", "source"}), timeout_s=150,
         note="rank C alone runs evaluate(model) between steps 1 and 2: its FSDP pre-forward "
              "all-gathers (every block, in order) pair silently with the other rank's step-2 "
              "training all-gathers (same blocks, same sizes); the ranks meet mismatched "
              "collectives a few later, in the other rank's backward, where gloo aborts one "
              "of them. The first divergence is rank C's all-gathers posted from evaluate "
              "(its model(x) line: the innermost user frame, MLP.forward, is shared with "
              "training and tells nothing); the others end in loss.backward(). The job has "
              "no experts: the advice names evaluate, the call only rank C makes"),
    # issue 18, case 3: a recv that no rank sends
    Case("recv_unsent", "recv_unsent.py", 2, DESYNC_OR_HANG,
         env={**culprit_env(0), "RECEIVER_RANK": "1"},
         mirror={**culprit_env(1), "RECEIVER_RANK": "0"}, culprits=C,
         lines=(at(rank("RECEIVER_RANK"), "recv"), at(C, "allreduce")),
         fix_require=("send",),
         fix_forbid=POST_TOO + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"program_order", "waited_for", "cycle"}),
         note="under `if rank == student` the receiver posts recv(src=C); no line of the job "
              "sends it, and rank C went on to the loss all-reduce. The peer of a recv posts "
              "a send (dst=receiver), or the recv goes: 'post that too' answers a recv with "
              "a recv"),
    # issue 18, case 5: an exception raised in a DataLoader worker, re-raised in the rank
    Case("dataloader_keyerror", "dataloader_keyerror.py", 2, frozenset({"crash"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "getitem"), at(others(C, 2), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG + TRANSPORT_ADVICE,
         summary_contains="KeyError: \"sample 37: missing 'labels' field\"",
         basis=frozenset({"exception"}), certainty=frozenset({"definite"}),
         note="record 37 of rank C's shard has no labels: Dataset.__getitem__ raises in the "
              "DataLoader worker (num_workers=1), the loader re-raises it in the rank as "
              "'KeyError: Caught KeyError in DataLoader worker process 0.' with the original "
              "traceback as text. The error to report is the original one, at __getitem__'s "
              "raise, not the `for batch in loader` line"),
    # issue 18, case 7: SIGSEGV inside a C call made through ctypes
    Case("segv_rank", "segv_rank.py", 2, frozenset({"rank_died"}),
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "segv"), at(others(C, 2), "allreduce")),
         fix_forbid=NOT_A_COLLECTIVE_BUG, summary_contains="SIGSEGV",
         basis=frozenset({"exited"}), certainty=frozenset({"definite"}),
         note="rank C calls ctypes.string_at(0) at step 2 and dies with SIGSEGV; its fatal "
              "stack's innermost frame is ctypes/__init__.py (Python's own library): the "
              "line to show is the job's, which called it"),
    Case("dtensor_ragged_gather", "dtensor_ragged_gather.py", 2, DESYNC, culprits=every(2),
         # the rank that received fewer bytes than it expected gets through (gloo lets it)
         # and dies further on: only the line it posted the gather from is fixed
         lines=(at(every(2), "gather", "divergence"),),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + TRANSPORT_ADVICE,
         basis=frozenset({"ambiguous"}),
         note="68 vs 401 rows through DTensor.from_local(Shard(0)).full_tensor(): the code "
              "is wrong on every rank; the varlen gather is the right fix here"),
    # issue 27: a skip inside a training loop (the next collective at an earlier line), a
    # silent pairing, a thread's collective — and the same jobs' torch dumps, post mortem
    Case("ddp_skip_loss", "ddp_skip_loss.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(others(C, 2), "loss", "divergence"), at(C, "backward", "divergence?")),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history"}),
         note="rank C skips the logged loss all-reduce of step 3 and goes on to step 4's "
              "backward (an earlier line); its gradient bucket pairs with the other's loss "
              "and gloo aborts the other. Line order across iterations would blame the "
              "other rank; every earlier step's order (bucket, then loss) names rank C"),
    Case("ddp_microbatch_count", "ddp_microbatch_count.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "backward", "divergence"), at(others(C, 2), "loss", "divergence")),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + POST_TOO,
         fix_require=("same count",), basis=frozenset({"history"}),
         note="written for the occasion: rank C runs a third micro-batch at step 3 (its own "
              "packing); its bucket all-reduce meets the other's loss all-reduce. Every "
              "earlier step (DDP's warm-up of two steps' length, then bucket, bucket, loss) "
              "names rank C; the stacks cannot tell one more pass from a skipped loss, so "
              "the advice names both"),
    Case("grad_none_skip", "grad_none_skip.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "loss", "divergence"), at(others(C, 2), "grad_allreduce", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("left the loop",),
         fix_require=("p.grad is not None",), basis=frozenset({"history"}),
         note="written for the occasion: rank C's expert 2 gets no token at step 3, so its "
              "two gradients are None and their async all-reduces are skipped; equal sizes "
              "pair silently until the loss all-reduce. The gate inside the loop (and fewer "
              "laps) are the ways past a collective of one line skipped on a later lap"),
    Case("best_checkpoint", "best_checkpoint.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "save", "divergence"), at(others(C, 3), "backward", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("left the loop",),
         fix_require=("if val < best:", "held on"), basis=frozenset({"majority"}),
         note="written for the occasion: every rank scores its own validation shard and "
              "saves the best model with torch.distributed.checkpoint where its own score "
              "improved; at step 4 only rank C does, its save's all-gather meeting the "
              "others' next DDP backward. It went through their line (every pass posts "
              "it): its collective is the extra, in the branch its data took"),
    # (these four: a rank past the training loop against the loop's next collective — where
    # the loop ends is nothing the agreed steps showed (ladder._past_the_loop): the count of
    # ranks decides, not history)
    Case("iter_shard_break", "iter_shard_break.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "barrier", "divergence"), at(others(C, 3), "grad_allreduce", "divergence")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("left the loop", "its one way out before its end: `break`"),
         basis=frozenset({"majority"}),
         note="written for the occasion: hand-sharded samples (data[rank::world]), 16 on "
              "rank C and 17 on the others; C's iterator runs out a step early and it breaks "
              "out to the final barrier"),
    Case("iter_shard_break_attach", "iter_shard_break.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(2), mirror=culprit_env(0), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "barrier"), at(others(C, 3), "grad_allreduce")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("left the loop", "its one way out before its end: `break`"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C in the final barrier, the others in the loop's gradient "
              "all-reduce; the loop's way out is the `break` on StopIteration (was: \"every "
              "rank must post the same collectives\", no loop named)"),
    Case("nan_skip_ddp", "nan_skip_ddp.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "barrier", "divergence"), at(others(C, 3), "backward", "divergence")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("`if not torch.isfinite(loss): continue`",),
         basis=frozenset({"majority"}),
         note="written for the occasion: DDP, `if not torch.isfinite(loss): continue` before "
              "backward; rank C's corrupt sample skips one step's buckets, which pair "
              "silently with the others' next; it ends in the final barrier"),
    Case("nan_skip_ddp_attach", "nan_skip_ddp.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(2), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "barrier"), at(others(C, 3), "backward")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("one way past their collective within a pass",
                      "`if not torch.isfinite(loss): continue`"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C in the final barrier, the others in the last backward; "
              "no way out of the loop, the guard that skips a pass (was: \"every rank must "
              "post the same collectives\", no line)"),
    Case("fsdp2_accum_count", "fsdp2_accum_count.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "backward", "divergence"), at(others(C, 3), "backward", "divergence")),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("only where gradient sync is on", "more micro-batches this step"),
         basis=frozenset({"history"}),
         note="written for the occasion: FSDP2, micro-batches per step from each rank's own "
              "data, sync on the last; rank C's third micro-batch all-gathers where the "
              "others reduce gradients"),
    Case("fsdp2_accum_count_attach", "fsdp2_accum_count.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(2), mirror=culprit_env(0), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "backward"), at(others(C, 3), "backward")),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("only where gradient sync is on", "more micro-batches this step"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C in FSDP's pre-backward all-gather, the others in its "
              "post-backward reduce-scatter, all at the backward's line"),
    Case("broadcast_root_differs", "broadcast_root_differs.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(every(3), "broadcast"),),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("the same src",), basis=frozenset({"majority"}),
         note="written for the occasion: broadcast_object_list(src=best), best from each "
              "rank's own copy of the scores; rank C's is stale at epoch 2"),
    Case("broadcast_root_differs_attach", "broadcast_root_differs.py", 3, DESYNC,
         mode="diagnose", env=culprit_env(1), mirror=culprit_env(0), culprits=C, marks=1,
         settle_s=3.0, lines=(at(every(3), "broadcast"),),
         fix_forbid=SKIP_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("the same src",), basis=frozenset({"majority"}),
         note="stacks only: the roots from the broadcast's arguments"),
    Case("hook_sync_skip", "hook_sync_skip.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "barrier", "divergence"), at(others(C, 3), "hook_allreduce", "divergence")),
         fix_forbid=(*DTYPE_ADVICE, "DistributedSampler"),
         fix_require=("a gradient hook", "never runs for a parameter that got no gradient"),
         basis=frozenset({"history"}),
         note="written for the occasion: gradients all-reduced from post-accumulate-grad "
              "hooks; rank C's easy batch skips a block, whose parameters' hooks never post; "
              "the shift carries to the end, where it waits in the final barrier"),
    Case("early_stop_branch", "early_stop_branch.py", 4, DESYNC,
         env=culprit_env(2), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "flag", "divergence"), at(others(C, 4), "grad_allreduce", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("left the loop",),
         fix_require=("val < best_val",), basis=frozenset({"history"}),
         note="written for the occasion: rank C alone posts the early-stopping flag (its own "
              "validation shard improved) after the stats all-reduce; the others are in the "
              "next step's inner loop over the parameters, a pass on: not a loop it left, "
              "the branch its data took"),
    Case("resume_step_skew", "resume_step_skew.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "backward", "divergence"), at(others(C, 3), "eval", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("its own data",),
         fix_require=("out of step in the loop", "`if step % 4 == 0:`"),
         basis=frozenset({"majority"}),
         note="written for the occasion: rank C resumed from a stale step, its loop a step "
              "ahead of the others' numbering; the others' evaluation all-reduce under "
              "`if step % 4 == 0:` meets its bucket all-reduce (was: the others blamed by "
              "history, a periodic collective the recorded steps had not reached)"),
    Case("timed_checkpoint", "timed_checkpoint.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=others(C, 3),
         lines=(at(others(C, 3), "save", "divergence"), at(C, "backward", "divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("too: it went on",),
         fix_require=("`if time.monotonic() - last_save > SAVE_EVERY_S:`", "held on"),
         basis=frozenset({"history"}),
         note="written for the occasion: a checkpoint every 1.5 s by each rank's own clock; "
              "rank C's started later, the others' save meets its next backward (was: "
              "\"make ranks 0, 2 post the collective at the backward too\", which they had)"),
    Case("timed_checkpoint_attach", "timed_checkpoint.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "backward"), at(others(C, 3), "save")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("`if time.monotonic() - last_save > SAVE_EVERY_S:`", "a pass on"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C a pass on (its `step` one more) in its backward, the others "
              "in the save's all-gather: the gate it went through in their pass (was: "
              "\"every rank must post the same collectives\", no line)"),
    Case("oom_skip", "oom_skip.py", 3, DESYNC,
         env=culprit_env(1), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "barrier", "divergence"), at(others(C, 3), "backward", "divergence")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("`except RuntimeError: ... continue`",),
         basis=frozenset({"majority"}),
         note="written for the occasion: `except RuntimeError: ... continue` around forward "
              "and backward; rank C's long batch runs out of memory, its buckets pair "
              "silently with the others' next step; it ends in the final barrier"),
    Case("oom_skip_attach", "oom_skip.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(1), mirror=culprit_env(2), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "barrier"), at(others(C, 3), "backward")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("one way past their collective within a pass",
                      "`except RuntimeError: ... continue`"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C in the final barrier, the others in the last backward; "
              "the handler that skips the batch is the way past (was: no line)"),
    Case("val_uneven", "val_uneven.py", 3, DESYNC,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "backward", "divergence"), at(others(C, 3), "val_allreduce",
                                                    "divergence")),
         fix_forbid=DTYPE_ADVICE + ANCHOR_ADVICE + ("too: it went on",),
         fix_require=("left the loop at", "different numbers of iterations"),
         basis=frozenset({"history"}),
         note="written for the occasion: per-batch validation all-reduces over each rank's "
              "own files, rank C's a batch fewer; it returns from validate() and its next "
              "epoch's bucket meets the others' last validation all-reduce"),
    Case("early_stop_rank", "early_stop_rank.py", 3, DESYNC,
         env=culprit_env(0), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "barrier", "rank+divergence"),
                at(others(C, 3), "backward", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("DistributedSampler",),
         fix_require=("takes the one early way out", "rank == logger"),
         basis=frozenset({"majority"}),
         note="written for the occasion: the logging rank C alone runs the patience check "
              "and breaks out of the epoch loop; the loop's one way out before its end is "
              "under a rank condition only C takes: its decision alone, broadcast it"),
    Case("early_stop_rank_attach", "early_stop_rank.py", 3, DESYNC, mode="diagnose",
         env=culprit_env(0), mirror=culprit_env(2), culprits=C, marks=1, settle_s=3.0,
         lines=(at(C, "barrier"), at(others(C, 3), "backward")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("DistributedSampler",),
         fix_require=("takes the one early way out", "rank == logger"),
         basis=frozenset({"majority"}),
         note="stacks only: rank C in the final barrier, the others idle inside "
              "loss.backward() (in what DDP's hooks posted, not outside every collective)"),
    Case("skip_gather_in_loop", "skip_gather_in_loop.py", 2, DESYNC_OR_HANG,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "reduce"), at(others(C, 2), "gather")),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history"}),
         note="rank C routes no token at iteration 4 (the data, not a rank condition), skips "
              "its all-gather and waits in iteration 5's all-reduce (an earlier line) while "
              "the other waits in the all-gather"),
    Case("skip_gather_in_loop_dumps", "skip_gather_in_loop.py", 2, DESYNC_OR_HANG,
         mode="analyze", form="pickle",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "reduce"), at(others(C, 2), "gather")),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history"}),
         note="the same job post mortem: torch's own pickle dumps (with frames)"),
    Case("skip_gather_in_loop_json", "skip_gather_in_loop.py", 2, DESYNC_OR_HANG,
         mode="analyze", form="json",
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         no_lines=True,
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history"}),
         note="the same job post mortem from torch's JSON dumps: no frames, no lines; every "
              "earlier iteration's order (all-reduce, all-gather) still names rank C"),
    Case("fsdp2_eval_between_steps", "fsdp2_eval_between_steps.py", 2, DESYNC,
         env=culprit_env(0), mirror=culprit_env(1), culprits=C,
         lines=(at(C, "eval", "divergence"),),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         basis=frozenset({"history"}), timeout_s=180,
         note="rank C alone runs an evaluation forward after step 2: its all-gathers pair "
              "silently with the other's training ones, and gloo aborts a rank steps later; "
              "the evaluation's all-gathers come from a path no agreed step posted from"),
    Case("a2a_no_grad_fn", "a2a_no_grad_fn.py", 2, frozenset({"crash"}), culprits=every(2),
         lines=(at(every(2), "backward"),), summary_contains="the same error on each",
         fix_forbid=("only failed because", *SKIP_ADVICE, *VARLEN_ADVICE, *ANCHOR_ADVICE),
         basis=frozenset({"exception"}), certainty=frozenset({"definite"}),
         note="written for the occasion: an EP dispatch through all_to_all_single, which has "
              "no grad_fn; every rank raises the same RuntimeError at its backward, each on "
              "its own. The first by a few ms was named, 'the others only failed because it "
              "left'"),
    Case("a2a_empty_fast_path", "a2a_empty_fast_path.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "grads", "divergence"), at(others(C, 2), "counts", "divergence")),
         fix_forbid=("fewer laps", *VARLEN_ADVICE, *DTYPE_ADVICE, *ANCHOR_ADVICE),
         fix_require=("x_TD.shape[0] == 0",), basis=frozenset({"history"}),
         note="written for the occasion: an EP dispatch whose fast path returns before the "
              "count all-to-all where a rank has no token; the culprit waits in the same "
              "step's gradient all-reduce, inside the step loop: it ran no fewer laps, so "
              "the early return is the one way past (was: 'fewer laps' too)"),
    Case("thread_died", "thread_died.py", 3, frozenset({"hang"}),
         env=culprit_env(1), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "get"), at(others(C, 3), "broadcast", "divergence")), stall=5.0,
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("Fix the KeyError",), summary_contains="missing from the shard index",
         basis=frozenset({"exception"}), certainty=frozenset({"definite"}),
         note="written for the occasion: rank C's prefetch thread raises and ends; the rank "
              "lives on at q.get(), the others' threads wait in its broadcast: its thread's "
              "exception is the cause, at once (was: uncertain until --hang-after)"),
    Case("ep_mesh_fast_path", "ep_mesh_fast_path.py", 4, DESYNC,
         env=culprit_env(3), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "stats"),),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         fix_require=("x_TD.shape[0] == 0",),
         note="written for the occasion: rank C's layer returns before its ep all-to-all "
              "(no token); its ep partner waits there, it went on through dp to the world "
              "all-reduce: a cycle whose fix is the guard inside the layer"),
    Case("metrics_gather_skip", "metrics_gather_skip.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "grad", "rank+divergence"), at(others(C, 2), "gather", "rank+divergence")),
         fix_forbid=VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE + ("left the loop",),
         fix_require=("step % 4 == 3 and metrics",),
         note="written for the occasion: rank C's metrics dict is empty at step 7, so it skips "
              "the all_gather_object and waits in step 8's all-reduce at an earlier line; "
              "the recorders' only vote on the lap is the skipped line's own"),
    Case("metrics_thread", "metrics_thread.py", 2, DESYNC_OR_HANG,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(others(C, 2), "metric"), at(C, "barrier")),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         note="rank C's metrics thread skips step 3's all-reduce on its own group; the other "
              "rank's thread waits in its last one while its main thread joins it: that "
              "rank's line is the thread's all-reduce, not the join"),
    Case("mesh2d_order_swap_attach", "mesh2d_order_swap.py", 4, DESYNC_OR_HANG,
         mode="diagnose", env={"CULPRIT_RANKS": "2"}, mirror={"CULPRIT_RANKS": "0"},
         culprits=ranks("CULPRIT_RANKS"),
         lines=(at(fixed(1, 3), "stats"), at(ranks("CULPRIT_RANKS"), "swapped")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "same group"),
         fix_require=("a branch the others do not take",), stall=5.0, timeout_s=240.0,
         note="fuzz seed 84402917 job 73: a 2x2 mesh, the loop at the top level (no "
              "counters under py-spy); rank C all-reduces the stats before its dp gradient "
              "under `if FAULTY and step == 3`, the others run the else: one if every rank "
              "ran, one way on one rank, the other on three"),
    Case("mesh2d_silent_skip_attach", "mesh2d_silent_skip.py", 4, DESYNC_OR_HANG,
         mode="diagnose", env={"CULPRIT_RANKS": "0"}, mirror={"CULPRIT_RANKS": "2"},
         culprits=ranks("CULPRIT_RANKS"),
         lines=(at(ranks("CULPRIT_RANKS"), "tp_reduce"),
                at(others(ranks("CULPRIT_RANKS"), 4), "loss")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "same group"),
         fix_require=("did not take `if not (FAULTY and step == FAULT_STEP):`",),
         stall=5.0, timeout_s=240.0,
         note="fuzz seed 84402917 job 59: a 2x2 mesh, the loop at the top level; rank C "
              "skips the world accuracy all-reduce under `if not (FAULTY and step == 2)`, "
              "its loss all-reduce (size 1) pairs with theirs and it waits a pass on in the "
              "tp all-reduce: the loop's one way to post fewer names it"),
    # the shapes post mortem, from torch's own dumps (no moe-hang in the job; a
    # job whose ranks gloo aborts, as ddp_skip_loss, leaves none)
    Case("fsdp2_eval_between_steps_dumps", "fsdp2_eval_between_steps.py", 2, DESYNC,
         mode="analyze", form="pickle", env=culprit_env(0), mirror=culprit_env(1),
         culprits=C, lines=(at(C, "eval", "divergence?"),),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         timeout_s=180, note="fsdp2_eval_between_steps from torch's pickle dumps"),
    Case("fsdp2_eval_between_steps_json", "fsdp2_eval_between_steps.py", 2, DESYNC,
         mode="analyze", form="json", env=culprit_env(0), mirror=culprit_env(1),
         culprits=C, no_lines=True,
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         timeout_s=180, note="fsdp2_eval_between_steps from torch's JSON dumps (no frames)"),
    Case("metrics_thread_dumps", "metrics_thread.py", 2, DESYNC_OR_HANG, mode="analyze",
         form="pickle", env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(others(C, 2), "metric"),),
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         note="metrics_thread from torch's pickle dumps"),
    Case("metrics_thread_json", "metrics_thread.py", 2, DESYNC_OR_HANG, mode="analyze",
         form="json", env=culprit_env(1), mirror=culprit_env(0), culprits=C, no_lines=True,
         fix_forbid=SKIP_ADVICE + VARLEN_ADVICE + DTYPE_ADVICE + ANCHOR_ADVICE,
         note="metrics_thread from torch's JSON dumps (no frames)"),
    Case("nested_epoch_extra_dumps", "nested_epoch_extra.py", 2, DESYNC, mode="analyze",
         form="pickle", env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "loss", "divergence?"),),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "never posts", "too: it went on"),
         note="nested_epoch_extra from torch's pickle dumps"),
    Case("nested_epoch_extra_json", "nested_epoch_extra.py", 2, DESYNC, mode="analyze",
         form="json", env=culprit_env(1), mirror=culprit_env(0), culprits=every(2),
         no_lines=True, basis=frozenset({"ambiguous"}),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "never posts", "too: it went on"),
         note="nested_epoch_extra from torch's JSON dumps (no frames): every all-reduce "
              "reads alike, a run never seen to end; one rank's barrier against the "
              "other's all-reduce is one more of it or one fewer: no culprit"),
    Case("loss_alert", "loss_alert.py", 3, DESYNC_OR_HANG,
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "alert"), at(others(C, 3), "grads")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop"),
         fix_require=("in `if mine > 5.0:`",),
         note="written for the occasion: each rank all_gather_objects an alert when its own "
              "batch loss spikes; rank C's shard is noisier: its alert meets the others' "
              "next gradient all-reduce. The branch its data took"),
    Case("loss_alert_attach", "loss_alert.py", 3, DESYNC_OR_HANG, mode="diagnose",
         env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "alert"), at(others(C, 3), "grads")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop"),
         fix_require=("in `if mine > 5.0:`",), stall=5.0, timeout_s=240.0,
         note="the same under diagnose (stacks alone, the loop at the top level: no "
              "counters): the minority in a branch of a test on its own data that the "
              "others' line is outside of; was the generic order advice"),
    Case("loss_alert_dumps", "loss_alert.py", 3, DESYNC_OR_HANG, mode="analyze",
         form="pickle", env=culprit_env(2), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "alert"), at(others(C, 3), "grads")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop"),
         note="the same from torch's pickle dumps"),
    Case("dead_expert_log", "dead_expert_log.py", 4, DESYNC,
         env=culprit_env(1), mirror=culprit_env(2), culprits=C,
         lines=(at(C, "dead"), at(others(C, 4), "grads")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "rank-only evaluation"),
         fix_require=("under `if (counts_E == 0).any()`", "a neutral value"),
         note="written for the occasion: async metric logging in a small MoE trainer; the "
              "rank whose batch left an expert without tokens also all-reduces a dead-expert "
              "counter, which meets the others' gradient all-reduce. The data decision"),
    Case("mesh2d_row_wrong_group", "mesh2d_row_wrong_group.py", 8, DESYNC_OR_HANG,
         env={"CULPRIT_RANKS": "4,5,6,7"}, mirror={"CULPRIT_RANKS": "0,1,2,3"},
         culprits=ranks("CULPRIT_RANKS"),
         lines=(at(ranks("CULPRIT_RANKS"), "stats"),
                at(others(ranks("CULPRIT_RANKS"), 8), "dp_reduce")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "dummy input"),
         fix_require=("group",), stall=3.0, nnodes=2, timeout_s=300.0,
         note="fuzz seed 77163029 job 46: a 2x4 mesh on two nodes, a whole tp row posts "
              "its dp all-reduce on tp and waits in the world stats: every rank of the row "
              "is named (a heartbeat's group ids are its own numbering, not group names)"),
    Case("mesh2d_behind_extra", "mesh2d_behind_extra.py", 8, DESYNC_OR_HANG,
         env={"CULPRIT_RANKS": "6", "MOE_HANG_FR_STACKS": "0"},
         mirror={"CULPRIT_RANKS": "5"}, culprits=ranks("CULPRIT_RANKS"),
         lines=(at(ranks("CULPRIT_RANKS"), "loss"),
                at(lambda env: frozenset(r for r in range(8) if r % 2 == int(
                    env["CULPRIT_RANKS"]) % 2) - ranks("CULPRIT_RANKS")(env), "dp_reduce")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "same group", "skipped"),
         fix_require=("posted more collectives on default_pg",), stall=5.0, timeout_s=300.0,
         note="fuzz seed 77163029 job 68, no stacks in the recorder (as beside a busy "
              "neighbour no dump answers): one rank's extra world all-reduce pairs "
              "silently with the others' loss, and it waits in its loss a pass behind its "
              "dp peers: one more on the world group, not one fewer on dp in their pass"),
    Case("async_list_skip", "async_list_skip.py", 6, DESYNC_OR_HANG,
         env={"CULPRIT_RANKS": "0", "MOE_HANG_FR_STACKS": "0"},
         mirror={"CULPRIT_RANKS": "4"}, culprits=ranks("CULPRIT_RANKS"),
         lines=(at(ranks("CULPRIT_RANKS"), "finish"),
                at(others(ranks("CULPRIT_RANKS"), 6), "loss"),
                at(others(ranks("CULPRIT_RANKS"), 6), "ntok", "divergence")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop", "dummy input"),
         fix_require=("posted fewer collectives on default_pg",), timeout_s=270.0,
         note="fuzz seed 40271193 job 94, no stacks in the recorder (as beside a busy "
              "neighbour no dump answers): the others wait at `for work in pending: "
              "work.wait()`; their line is the last post (the loss), and the skip is read "
              "from the counts: the culprit's barrier right after the loop is the number "
              "they wait in at their loss"),
    Case("pipeline_silent_extra", "pipeline_silent_extra.py", 6, DESYNC_OR_HANG,
         mode="diagnose",
         env={"FUZZ_AT_ACC": "0", "FUZZ_AT_LOSS": "2", "FUZZ_AT_RECV": "3,4,5",
              "FUZZ_AT_SEND": "1", "CULPRIT_RANKS": "2"},
         mirror={"FUZZ_AT_ACC": "", "FUZZ_AT_LOSS": "0", "FUZZ_AT_RECV": "1,2,3,4,5",
                 "FUZZ_AT_SEND": "", "CULPRIT_RANKS": "0"},
         culprits=ranks("CULPRIT_RANKS"),
         lines=(at(ranks("FUZZ_AT_ACC"), "acc"), at(ranks("FUZZ_AT_LOSS"), "loss"),
                at(ranks("FUZZ_AT_RECV"), "recv"), at(ranks("FUZZ_AT_SEND"), "send")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "never posts", "left the loop", "dummy input",
                     "same group"),
         fix_require=("posted more collectives on default_pg",), timeout_s=210.0,
         note="fuzz seed 38502719 job 46, stacks alone: the stages in their send/recv are "
              "placed by the ops that answer theirs — a pass on from the culprit, whose "
              "extra all-reduce paired with their loss; not a camp of their own"),
    Case("nested_epoch_extra", "nested_epoch_extra.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "loss", "divergence"), at(C, "acc"), at(others(C, 2), "finish")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "never posts", "too: it went on"),
         fix_require=("ran the loop more times",), basis=frozenset({"history"}),
         note="written for the occasion: epochs of batches, rank C's shard a batch longer "
              "in epoch 1; size-1 loss and accuracy all-reduces pair silently to the final "
              "barrier: the loss is posted several times running, the step's count decides"),
    Case("nested_epoch_uneven", "nested_epoch_uneven.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "grad"), at(others(C, 2), "acc", "rank+divergence")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "never posts", "too: it went on"),
         fix_require=("ran the loop more times",),
         note="written for the occasion: the same with gradients all-reduced per "
              "parameter: rank C's weight gradient meets the others' accuracy, gloo aborts"),
    Case("accum_skip", "accum_skip.py", 2, DESYNC,
         env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "ckpt"), at(others(C, 2), "sync")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop"),
         fix_require=("`if micro == ACCUM:` around it", "in their pass"),
         note="written for the occasion: gradient accumulation counted on each rank, a "
              "corrupt batch skipped on rank C: at step 7 it skips the gradient helper "
              "(`if micro == ACCUM:`) and waits in the checkpoint barrier"),
    Case("accum_skip_attach", "accum_skip.py", 2, DESYNC,
         mode="diagnose", env=culprit_env(1), mirror=culprit_env(0), culprits=C,
         lines=(at(C, "ckpt"), at(others(C, 2), "sync")),
         fix_forbid=(*NOT_A_COLLECTIVE_BUG, "left the loop"),
         fix_require=("`if micro == ACCUM:` around it", "in their pass"),
         note="the same, stacks alone: at `train` both ranks' `step` is 7, the culprit's "
              "line later in that pass"),
)
