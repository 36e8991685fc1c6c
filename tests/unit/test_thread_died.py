"""A prefetch thread that broadcasts each batch on a data group dies of an exception on one
rank (a KeyError from its shard index): the rank lives on, its main thread waits at
``q.get()`` for batches that never come, and the others' threads wait in the broadcast it
will never post. Written as a new user's job (``thread_died_jobs/``), recorded under
``moe-hang watch --stall 5`` on 3 ranks in two roles. Was: "Rank 1 is outside any collective
... slow I/O or a checkpoint resolves by itself", uncertain, and watch waited out
``--hang-after`` (300 s)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, short", [("thread_died_1", 1), ("thread_died_2", 2)])
def test_a_thread_that_raised_and_ended_is_the_cause_of_the_hang(fixtures, name, short):
    """The thread that posted the rank's broadcasts on the data group is not among its
    threads at capture, and it recorded the exception that ended it: a hang for certain, its
    exception the cause, its line the one to open."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["certainty"]) == (
        "hang", [short], "exception", "definite"), d["summary"]
    assert d["rule_id"] == "outside"
    s = d["summary"]
    assert f"Rank {short}'s thread Thread-1 (prefetch) raised KeyError" in s, s
    assert "train_prefetch.py:23" in s and "will never post" in s, s
    assert "Fix the KeyError" in d["fix"] and "hand it to the main thread" in d["fix"]


@pytest.mark.parametrize("name, short", [("thread_died_1", 1), ("thread_died_2", 2)])
def test_a_posting_thread_that_ended_without_a_record_still_decides(
        fixtures, tmp_path: Path, name, short):
    """The same capture without the thread's exception record (an older probe, a thread
    that returned): its posting thread is gone, so it will never post what the others wait
    in — likely (another thread of the rank could yet post there), and no cause is named
    beyond the thread's end."""
    root = tmp_path / name
    shutil.copytree(fixtures / name, root)
    (root / "ranks" / f"rank{short}.thread_errors.json").unlink()
    d = diagnose(load_capture(root)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["certainty"]) == (
        "hang", [short], "waited_for", "likely"), d["summary"]
    assert "has ended" in d["summary"] and "KeyError" not in d["summary"], d["summary"]


def test_an_exception_from_before_the_threads_last_post_is_not_its_end(fixtures, tmp_path):
    """A record under the poster's id but older than its last collective on the group (a
    pthread id reused by a later thread): not the exception that ended the poster — likely,
    no cause named."""
    import json

    root = tmp_path / "cap"
    shutil.copytree(fixtures / "thread_died_1", root)
    path = root / "ranks" / "rank1.thread_errors.json"
    errs = json.loads(path.read_text())
    errs[0]["time"] = 1.0
    path.write_text(json.dumps(errs))
    d = diagnose(load_capture(root)).to_dict()
    assert (d["culprit_ranks"], d["culprit_basis"], d["certainty"]) == (
        [1], "waited_for", "likely"), d["summary"]
