"""A generated job's source: a plain Python training script, the way users write them (a
loop, a model, an optimizer step, their own logging), importing only torch. The fault sits at
lines marked ``# corpus: <name>``, under ``FAULTY and step == FAULT_STEP``, where ``FAULTY``
comes from ``$CULPRIT_RANKS``: the mirrored twin swaps the roles through the environment."""

from __future__ import annotations

import re

from moe_hang.testing.fuzz.catalogue import SHIFTS
from moe_hang.testing.fuzz.plant import Plant, first_coll
from moe_hang.testing.fuzz.sites import Family, Site

PLANTED = "FAULTY and step == FAULT_STEP"
IND = "    "
PLACEHOLDERS = ("{n}", "{dt}", "{group}", "{skip}")

HEADER = '''dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={pg_timeout}))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
# the ranks the fault is planted on: $CULPRIT_RANKS (the runner swaps them for the mirrored twin)
FAULTY = RANK in {{int(r) for r in os.environ.get("CULPRIT_RANKS", "{culprits}").split(",")}}
STEPS, FAULT_STEP = {steps}, {step}
torch.manual_seed(0)


def mark(name: str) -> None:
    """Tell the runner this rank got to ``name`` ($JOB_MARKS/<name>.rank<r>)."""
    d = os.environ.get("JOB_MARKS")
    if d:
        tmp = Path(d, f".{{name}}.rank{{RANK}}.tmp")
        tmp.write_text(str(time.time()))
        tmp.rename(Path(d, f"{{name}}.rank{{RANK}}"))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
'''

HELPERS = {
    "eval": '''def evaluate() -> float:
    """Validation accuracy, averaged over the ranks."""
    metrics = torch.tensor([1.0, 4.0, 2.0])  # correct, seen, batches
    dist.all_reduce(metrics)  # corpus: extra
    return float(metrics[0] / metrics[1])
''',
    "checkpoint": '''def save_checkpoint(step: int) -> None:
    """Write this rank's state, then wait until every rank has written its own."""
    state = {"step": step, "rank": RANK}
    print(f"checkpoint {state}", flush=True)
    dist.barrier()  # corpus: extra
''',
    "histogram": '''def log_histogram() -> None:
    """Gather a histogram of the activations for the logger."""
    hist = torch.empty(5 * WORLD)
    dist.all_gather_into_tensor(hist, torch.ones(5), group=LOG)  # corpus: extra
''',
    "runtime": '''def load_shard(step: int) -> None:
    """Read this step's data shard; a corrupt one raises."""
    if FAULTY and step == FAULT_STEP:
        raise RuntimeError(f"shard {step} of rank {RANK} is corrupt")  # corpus: raise
''',
    "lock": '''IO_LOCK, STATE_LOCK = threading.Lock(), threading.Lock()
IO_HELD, STATE_HELD = threading.Event(), threading.Event()


def background_flush() -> None:
    """A writer thread: takes the I/O lock, then the state lock."""
    with IO_LOCK:
        IO_HELD.set()
        STATE_HELD.wait(30)
        with STATE_LOCK:
            pass


def checkpoint_state() -> None:
    """Snapshot the state while a writer flushes the previous one: the state lock, then the
    I/O lock (the other order)."""
    threading.Thread(target=background_flush, daemon=True, name="flush").start()
    IO_HELD.wait(30)
    with STATE_LOCK:
        STATE_HELD.set()
        with IO_LOCK:  # corpus: lock
            pass
''',
    "busy": '''def busy(seconds: float) -> None:
    """A slower step on this rank only (a bigger batch, a slower host): it computes."""
    a = torch.randn(192, 192)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        a = torch.tanh(a @ a)  # corpus: busy
''',
}

CALL = {"eval": 'print(f"eval accuracy {evaluate():.3f}", flush=True)',
        "checkpoint": "save_checkpoint(step)",
        "histogram": "log_histogram()"}

# fsdp_eval: what the culprit alone runs between two steps (its helper, by variant)
FSDP_HELPERS = {
    "eval": '''def evaluate() -> float:
    """Validation loss on a held-out batch: a forward without gradients, on this rank only
    (FSDP2 all-gathers every unit's weights for it, as in training)."""
    g = torch.Generator().manual_seed(99)
    x_val, y_val = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    with torch.no_grad():
        out = {call}  # corpus: eval
    return float(torch.nn.functional.mse_loss(out, y_val))
''',
    "checkpoint": '''def save_full_checkpoint(step: int) -> None:
    """Gather each unit's full weights, one unit at a time, and write them (this rank writes
    the checkpoint)."""
    for unit in UNITS:
        unit.unshard()  # corpus: checkpoint
        weights = sum(p.numel() for p in unit.parameters())
        print(f"checkpoint {{step}}: {{type(unit).__name__}} {{weights}} weights", flush=True)
        unit.reshard()
''',
}
FSDP_CALL = {"eval": 'print(f"eval loss {evaluate():.3f}", flush=True)',
             "checkpoint": "save_full_checkpoint(step)"}
# an extra of the shifted kinds: a rank-only call of the same op and size as the site's
GNORM = "gnorm = torch.tensor([1.0])  # this rank also logs its gradient norm"
SHIFT_EXTRA = {
    "sync": [GNORM, "dist.all_reduce(gnorm)  # corpus: extra"],
    "async": [GNORM, "pending.append(dist.all_reduce(gnorm, async_op=True))  # corpus: extra"],
    "thread": ["LOGQ.put(torch.tensor([1.0, float(step)]))  # this rank also queues its "
               "gradient norm"],
}


def _marker_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\s*#\s*corpus:\s*{re.escape(name)}\s*$")


def _call_index(site: Site) -> int:
    pat = _marker_re(site.name)
    return next(i for i, line in enumerate(site.lines) if pat.search(line))


def _rename(line: str, old: str, new: str | None) -> str:
    """``line`` with its ``# corpus: old`` marker renamed ``new`` (or removed)."""
    if not _marker_re(old).search(line):
        return line
    stripped = _marker_re(old).sub("", line)
    return stripped if new is None else f"{stripped}  # corpus: {new}"


def _fill(lines: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for line in lines:
        for ph in PLACEHOLDERS:
            line = line.replace(ph, values.get(ph, _DEFAULT[ph]))
        out.append(line)
    return out


_DEFAULT = {"{n}": "0", "{dt}": "torch.float32", "{group}": "dp", "{skip}": "None"}


def _defaults(site: Site) -> dict[str, str]:
    return {"{n}": str(site.size[0]) if site.size else "0"}


def _indent(lines: list[str], by: str = IND) -> list[str]:
    return [by + line if line else line for line in lines]


def _insert_before_use(lines: list[str], placeholder: str | None, call: int,
                       planted: list[str]) -> list[str]:
    """``planted`` before the first line using ``placeholder`` (else before the call line),
    at that line's indentation."""
    at = next((i for i, line in enumerate(lines) if placeholder and placeholder in line), call)
    ind = re.match(r"\s*", lines[at]).group(0)  # type: ignore[union-attr]
    return lines[:at] + [ind + p for p in planted] + lines[at:]


def _site_lines(site: Site) -> list[str]:
    return _fill(list(site.lines), _defaults(site))


def _point_lines(plant: Plant) -> list[str]:
    """What a point kind puts before its site (at the loop body's indentation)."""
    k, v = plant.kind, plant.variant
    if k == "exception":
        if v == "assert":
            return [f'assert not ({PLANTED}), "the loss scale overflowed"  # corpus: raise']
        if v == "runtime":
            return ["load_shard(step)  # corpus: planted"]
        raise_line = {"value": 'raise ValueError("bad batch: NaN in the labels")',
                      "oom": 'raise torch.OutOfMemoryError("CUDA out of memory")'}[v]
        return [f"if {PLANTED}:", f"{IND}{raise_line}  # corpus: raise"]
    if k == "early_exit":
        return [f"if {PLANTED}:  # corpus: planted",
                f'{IND}print(f"rank {{RANK}}: out of data, leaving", flush=True)',
                f"{IND}dist.destroy_process_group()",
                f"{IND}sys.exit(0)"]
    if k == "sigkill":
        return [f"if {PLANTED}:", f"{IND}os.kill(os.getpid(), signal.SIGKILL)  # corpus: planted"]
    if k == "lock":
        return [f"if {PLANTED}:  # corpus: planted", f"{IND}checkpoint_state()"]
    if k == "sleep":
        return [f"if {PLANTED}:",
                f"{IND}time.sleep({plant.seconds:g})  # corpus: planted  (a slow checkpoint write)"]
    if k == "busy":
        return [f"if {PLANTED}:  # corpus: planted", f"{IND}busy({plant.seconds:g})"]
    raise ValueError(f"{k} is not a point kind")


def _planted_site_lines(site: Site, nxt: Site | None, plant: Plant) -> list[str]:
    k = plant.kind
    lines = list(site.lines)
    call = _call_index(site)
    values = _defaults(site)
    if (k in ("skip", "recv_no_send") and plant.variant in ("wrap", "")) or \
            (k in SHIFTS and plant.variant == "skip"):
        ind = re.match(r"\s*", lines[call]).group(0)  # type: ignore[union-attr]
        lines[call:call + 1] = [f"{ind}if not ({PLANTED}):  # corpus: planted",
                                f"{ind}{IND}{lines[call].strip()}"]
        return _fill(lines, values)
    if k == "skip" and plant.variant == "module":
        assert site.module_skip is not None
        planted = list(site.module_skip(plant.module))
        if "{skip}" in lines[call]:
            values["{skip}"] = "skip"
        return _fill(_insert_before_use(lines, "{skip}", call, planted), values)
    if k == "extra":
        return [*_fill(lines, values), f"if {PLANTED}:  # corpus: planted",
                f"{IND}{CALL[plant.variant]}"]
    if k in SHIFTS:
        c = first_coll(site)
        assert c is not None
        how = "thread" if c.thread else "async" if c.nowait else "sync"
        return [*_fill(lines, values), f"if {PLANTED}:  # corpus: planted",
                *_indent(SHIFT_EXTRA[how])]
    if k == "fsdp_eval":
        return [*_fill(lines, values), f"if {PLANTED}:  # corpus: planted",
                f"{IND}{FSDP_CALL[plant.variant]}"]
    if k == "size":
        assert site.size is not None
        planted = [f"n = {site.size[1]} if {PLANTED} else {site.size[0]}  # corpus: planted"]
        values["{n}"] = "n"
        return _fill(_insert_before_use(lines, "{n}", call, planted), values)
    if k == "dtype":
        planted = [f"dt = torch.float64 if {PLANTED} else torch.float32  # corpus: planted"]
        values["{dt}"] = "dt"
        return _fill(_insert_before_use(lines, "{dt}", call, planted), values)
    if k == "wrong_group":
        planted = [f"group = tp if {PLANTED} else dp  # corpus: planted"]
        values["{group}"] = "group"
        return _fill(_insert_before_use(lines, "{group}", call, planted), values)
    if k == "op_swap":
        assert site.alt is not None
        ind = re.match(r"\s*", lines[call]).group(0)  # type: ignore[union-attr]
        lines[call:call + 1] = [f"{ind}if {PLANTED}:  # corpus: planted",
                                f"{ind}{IND}{site.alt[1]}  # corpus: swapped",
                                f"{ind}else:",
                                f"{ind}{IND}{lines[call].strip()}"]
        return _fill(lines, values)
    if k == "order_swap":
        assert nxt is not None
        a, b = _site_lines(site), _site_lines(nxt)
        swapped = [_rename(line, nxt.name, "swapped") for line in b] + \
            [_rename(line, site.name, "swapped_then") for line in a]
        return [f"if {PLANTED}:  # corpus: planted", *_indent(swapped), "else:",
                *_indent(a + b)]
    raise ValueError(f"{k} ({plant.variant}) is not planted on a site")


def step_body(family: Family, plant: Plant) -> list[str]:
    """The loop body (unindented): the sites in order, the fault at its place."""
    body = ["if step == FAULT_STEP:", f'{IND}mark("hang")']
    sites = family.sites
    j = 0
    while j < len(sites):
        s = sites[j]
        if s.name != plant.site:
            body += _site_lines(s)
        elif plant.kind in ("exception", "early_exit", "sigkill", "lock", "sleep", "busy"):
            body += _point_lines(plant) + _site_lines(s)
        elif plant.kind == "skip" and plant.variant == "continue":
            body += [f"if {PLANTED}:  # corpus: planted",
                     f"{IND}continue  # this rank's data check rejected the batch: skip the step"]
            body += _site_lines(s)
        else:
            nxt = sites[j + 1] if j + 1 < len(sites) else None
            body += _planted_site_lines(s, nxt, plant)
            if plant.kind == "order_swap":
                j += 1
        j += 1
    return body


def helpers(plant: Plant, family: Family) -> list[str]:
    if plant.kind == "fsdp_eval":
        return [FSDP_HELPERS[plant.variant].format(call=family.eval_call)]
    if plant.kind == "extra":
        return [HELPERS[plant.variant]]
    if plant.kind == "exception" and plant.variant == "runtime":
        return [HELPERS["runtime"]]
    if plant.kind in ("lock", "busy"):
        return [HELPERS[plant.kind]]
    return []


def imports(family: Family, plant: Plant) -> list[str]:
    std = {"datetime", "os", "time", *family.std}
    if plant.kind == "early_exit":
        std.add("sys")
    if plant.kind == "sigkill":
        std.add("signal")
    if plant.kind == "lock":
        std.add("threading")
    lines = [f"import {m}" for m in sorted(std)]
    lines += ["from pathlib import Path", "", "import torch", "import torch.distributed as dist"]
    lines += list(family.imports)
    return lines


def render(family: Family, plant: Plant, culprits: str, doc: str,
           pg_timeout_s: int = 600) -> str:
    """The whole job: docstring, imports, the process group and roles, helpers, the model,
    the loop, the final barrier."""
    parts = [f'"""{doc}"""', "", *imports(family, plant), "",
             HEADER.format(pg_timeout=pg_timeout_s, culprits=culprits, steps=plant.steps,
                           step=plant.step)]
    for h in helpers(plant, family):
        parts += ["", h]
    parts += ["", family.setup, "", "for step in range(STEPS):",
              *_indent(step_body(family, plant)),
              *family.epilogue,
              "dist.barrier()  # corpus: finish",
              'print(f"rank {RANK}: done", flush=True)',
              "dist.destroy_process_group()", ""]
    return "\n".join(parts)
