"""The probe's record of the exception that ends a rank: on disk before anything slow, so
that torchrun's SIGTERM (a peer died, the job is torn down) cannot catch the rank before it
(fuzz 4071993 job 14: a rank ended inside linecache, reading torch's sources for a traceback,
and its line was lost)."""

from __future__ import annotations

import json
import linecache
import threading
import time
from pathlib import Path

import pytest

from moe_hang.probe import raised
from moe_hang.probe.probe import Probe

pytestmark = pytest.mark.timeout(60)


def _post() -> None:
    raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")  # the raising line


def _step() -> None:
    _post()


def test_the_exception_is_recorded_without_reading_any_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(*_args: object, **_kw: object) -> list[str]:
        raise AssertionError("the record read a source file")

    monkeypatch.setattr(linecache, "updatecache", no_source)
    monkeypatch.setattr(linecache, "getlines", no_source)
    monkeypatch.setattr(linecache, "checkcache", no_source)
    monkeypatch.setattr(linecache, "lazycache", no_source)
    probe = Probe(tmp_path, 3, 1.0)
    try:
        _step()
    except RuntimeError as exc:
        linecache.clearcache()
        probe.record_exception(exc)
    err = json.loads(probe.files.error.read_text())
    assert (err["type"], err["message"]) == ("RuntimeError",
                                             "Connection closed by peer [127.0.0.1]:1234")
    (inner_file, inner_line, inner_fn), (_, _, outer_fn) = err["frames"][:2]
    assert inner_file == __file__ and inner_fn == "_post" and outer_fn == "_step"
    assert "the raising line" in Path(__file__).read_text().splitlines()[inner_line - 1]


def test_an_exception_that_ends_a_thread_is_recorded_with_the_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """threading.excepthook, chained: the thread's name and id (the recorder's thread ids),
    the exception's line; the rank lives on (nothing of the rank's own exception is written),
    and Python's own report of it still comes after."""
    from moe_hang.evidence.load import load_rank
    from moe_hang.probe.layout import RunLayout

    printed: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.thread.name))
    (tmp_path / "ranks").mkdir()
    probe = Probe(tmp_path / "ranks", 1, 1.0)
    raised.chain_thread_excepthook(probe.record_thread_exception)

    def prefetch() -> None:
        raise KeyError("sample 51 missing")  # the raising line

    t = threading.Thread(target=prefetch, name="prefetch")
    t.start()
    t.join(10)
    errs = json.loads(probe.files.thread_errors.read_text())
    assert [(e["type"], e["thread"], e["thread_id"]) for e in errs] == [
        ("KeyError", "prefetch", str(t.ident))]
    assert errs[0]["frames"][0][2] == "prefetch" and printed == ["prefetch"]
    assert not probe.files.error.exists()
    ev = load_rank(RunLayout(tmp_path), 1)
    assert [(e.thread, e.thread_id, e.type) for e in ev.thread_errors] == [
        ("prefetch", str(t.ident), "KeyError")]


def _slow_record(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real = raised.error_record

    def slow(exc: BaseException, restarts: int) -> dict[str, object]:
        time.sleep(seconds)  # a loaded machine: the traceback walk takes this long
        return real(exc, restarts)

    monkeypatch.setattr(raised, "error_record", slow)


def _raise_and_record(probe: Probe) -> threading.Thread:
    def main() -> None:
        try:
            _step()
        except RuntimeError as exc:
            probe.record_exception(exc)

    t = threading.Thread(target=main)
    t.start()
    while raised._NOT_RECORDING.is_set() and t.is_alive():
        time.sleep(0.001)
    return t


def test_a_sigterm_during_the_record_ends_the_rank_only_once_it_is_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's failure ends the job while this rank's excepthook writes its own error: the
    SIGTERM relay (its thread calls on_sigterm, then lets the signal end the rank) waits for
    the record — the corpus had a rank ended inside it, its error lost (an empty .tmp)."""
    _slow_record(monkeypatch, 0.5)
    monkeypatch.setattr(Probe, "dump", lambda *_a, **_k: None)  # torch is not here
    probe = Probe(tmp_path, 1, 1.0)
    t = _raise_and_record(probe)
    assert not probe.files.error.exists()
    probe.on_sigterm()  # the relay's thread: the signal ends the rank when this returns
    assert json.loads(probe.files.error.read_text())["type"] == "RuntimeError"
    t.join(10)


def test_the_relay_waits_for_the_record_a_bounded_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_record(monkeypatch, 1.0)
    monkeypatch.setattr(raised, "RECORD_WAIT_S", 0.1)
    monkeypatch.setattr(Probe, "dump", lambda *_a, **_k: None)
    probe = Probe(tmp_path, 1, 1.0)
    t = _raise_and_record(probe)
    t0 = time.monotonic()
    probe.on_sigterm()
    assert time.monotonic() - t0 < 0.8 and not probe.files.error.exists()
    t.join(10)
