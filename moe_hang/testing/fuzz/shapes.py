"""The step layouts a family's own statements are put in (:func:`reshape`): what the user's
code around the model posts in one step.

- ``plain``: the user's logging (:data:`.sites.TAIL`); no two collectives of one op and size;
- ``loss``: two size-1 all-reduces at the step's end, an accuracy then the loss (the loss
  all-reduce after backward is the step's last collective); ``ntok``: and a third at its
  start, the step's token count (the loss is normalized by it). gloo pairs any of them with
  any other, by op and bytes, whichever line posted it;
- ``async``: those three posted with ``async_op=True`` and waited at the step's end, as every
  NCCL job waits (several in flight);
- ``thread``: the plain logging, and each step's loss queued to a metrics thread that
  all-reduces it on a group of its own; the main thread joins it after the loop."""

from __future__ import annotations

from dataclasses import replace

from moe_hang.testing.fuzz.events import Coll, Wait
from moe_hang.testing.fuzz.sites import TAIL_NAMES, Family, Site, one

SHAPES = ("plain", "loss", "ntok", "async", "thread")
SIZE1 = ("world", "all_reduce", "f32x1")  # the size-1 all-reduces of the loss layouts
THREAD = "metrics"  # the metrics thread's name
PENDING = "pending.append(dist.all_reduce({var}, async_op=True))"


def _size1(name: str, first: str, var: str, nowait: bool, *before: str) -> Site:
    call = PENDING.format(var=var) if nowait else f"dist.all_reduce({var})"
    return Site(name, (first, *before, f"{call}  # corpus: {name}"),
                one(Coll(*SIZE1, name, nowait=nowait)))


def ntok(nowait: bool) -> Site:
    first = "ntok = torch.tensor([float(x.shape[0])])  # this step's tokens, over the ranks"
    if nowait:
        return _size1("ntok", first, "ntok", True,
                      "pending = []  # the step's logging collectives, in flight until its end")
    return _size1("ntok", first, "ntok", False)


def acc(nowait: bool) -> Site:
    return _size1("acc", "acc = torch.tensor([float(step % 2)])  # this rank's accuracy",
                  "acc", nowait)


def loss(nowait: bool) -> Site:
    return _size1("loss", "loss_sum = torch.tensor([loss.item()])  # the loss, for the log",
                  "loss_sum", nowait)


WAIT = Site("wait", ("for work in pending:", "    work.wait()  # corpus: wait"),
            one(Wait("wait")), user=False, skip=None)
PUT = Site("put", ("LOGQ.put(torch.tensor([loss.item(), float(step)]))  # corpus: put",),
           one(Coll("thread", "all_reduce", "f32x2", "logger", thread=THREAD)))
THREAD_SETUP = '''METRICS = dist.new_group(list(range(WORLD)))  # the metrics thread's own group
LOGQ: "queue.Queue[torch.Tensor | None]" = queue.Queue()


def log_metrics() -> None:
    """The metrics thread: sums each queued tensor over the ranks, on a group of its own."""
    while (item := LOGQ.get()) is not None:
        dist.all_reduce(item, group=METRICS)  # corpus: logger


LOGGER = threading.Thread(target=log_metrics, name="metrics", daemon=True)
LOGGER.start()'''
THREAD_EPILOGUE = ("LOGQ.put(None)", "LOGGER.join()  # corpus: join")


def reshape(fam: Family, shape: str) -> Family:
    """``fam`` with its step in layout ``shape`` (its batch and core statements kept)."""
    if shape == "plain":
        return fam
    core = [s for s in fam.sites if s.name not in TAIL_NAMES]
    batch, rest = core[0], tuple(core[1:])
    if shape == "loss":
        return replace(fam, sites=(batch, *rest, acc(False), loss(False)), shape=shape)
    if shape == "ntok":
        return replace(fam, sites=(batch, ntok(False), *rest, acc(False), loss(False)),
                       shape=shape)
    if shape == "async":
        return replace(fam, sites=(batch, ntok(True), *rest, acc(True), loss(True), WAIT),
                       shape=shape)
    if shape == "thread":
        return replace(fam, sites=(*fam.sites, PUT), shape=shape,
                       setup=f"{fam.setup}\n{THREAD_SETUP}", std=("queue", "threading"),
                       epilogue=THREAD_EPILOGUE)
    raise ValueError(f"unknown step layout {shape!r}; known: {', '.join(SHAPES)}")
