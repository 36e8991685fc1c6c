"""For the corpus's ``analyze`` cases: torch's own Flight Recorder dumps of a stuck job, as
NCCL's watchdog writes them at its timeout (gloo has no such watchdog, so a thread here plays
it): once the recorder shows a collective pending and nothing changed for
``CORPUS_FR_STALL_S`` seconds, this rank writes ``_dump_fr_trace()`` (pickle, with stack
traces) to ``$CORPUS_FR_DUMP/pickle/comm_lib_trace_rank_<rank>`` and ``_dump_fr_trace_json()``
to ``$CORPUS_FR_DUMP/json/comm_lib_trace_rank_<rank>.json`` (temporary name, then renamed).
A rank that dies first (gloo's abort) writes nothing — as with NCCL. Nothing happens without
``CORPUS_FR_DUMP``. Bounded: the thread gives up after ``CORPUS_FR_LIMIT_S``."""

import os

if os.environ.get("CORPUS_FR_DUMP"):
    import json
    import sys
    import threading
    import time

    def _write(path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _watch() -> None:
        out = os.environ["CORPUS_FR_DUMP"]
        stall = float(os.environ.get("CORPUS_FR_STALL_S", "3"))
        deadline = time.monotonic() + float(os.environ.get("CORPUS_FR_LIMIT_S", "300"))
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            torch = sys.modules.get("torch")
            dist = sys.modules.get("torch.distributed")
            # the job may be importing torch.distributed right now (the module is in
            # sys.modules before its names are): not there yet is "not initialized", never
            # an exception that ends this thread (the corpus's flaky post-mortem runs)
            ready = getattr(dist, "is_initialized", None)
            try:
                if torch is None or dist is None or ready is None or not ready():
                    continue
            except Exception:
                continue
            try:
                c10d = torch._C._distributed_c10d
                status = json.loads(c10d._dump_fr_trace_json(includeCollectives=False)
                                    ).get("pg_status", {})
            except Exception:
                continue
            pending = any(int(s.get("last_enqueued_collective", -1))
                          > int(s.get("last_completed_collective", -1))
                          for s in status.values())
            if status != last:
                last, since = status, time.monotonic()
                continue
            if not pending or time.monotonic() - since < stall:
                continue
            rank = dist.get_rank()
            try:  # the JSON first: instant; the pickle's stack traces take a while
                raw = c10d._dump_fr_trace_json()
                _write(f"{out}/json/comm_lib_trace_rank_{rank}.json",
                       raw if isinstance(raw, bytes) else raw.encode())
                _write(f"{out}/pickle/comm_lib_trace_rank_{rank}",
                       bytes(c10d._dump_fr_trace(includeStackTraces=True)))
            except Exception:
                pass
            return

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    threading.Thread(target=_watch, name="corpus-fr-watchdog", daemon=True).start()
