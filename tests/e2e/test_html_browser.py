"""The HTML report as a user looks at it: in Chromium, 1280 px wide (issue 30, item 7). A
copy of the page gets a script that measures the laid-out page (the report itself carries
none) and Chromium prints the DOM after it ran. Skipped where no Chromium is installed
(Debian: ``apt-get install chromium``); CI has none."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import relocated, run_cli

CHROMIUM = next((p for n in ("chromium", "chromium-browser", "google-chrome")
                 if (p := shutil.which(n))), None)
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here"),
              pytest.mark.timeout(120)]

MEASURE = """<script>
(() => {
  const box = e => e.getBoundingClientRect();
  const out = {page: document.documentElement.scrollWidth, view: innerWidth, tables: []};
  for (const t of document.querySelectorAll('table')) {
    const scroller = t.closest('.pair > div') || t.parentElement;
    out.tables.push({cls: t.className, right: Math.round(box(t).right),
                     top: Math.round(box(t).top), width: Math.round(box(t).width),
                     inside: Math.round(box(scroller).right),
                     scrolls: scroller.scrollWidth > scroller.clientWidth});
  }
  out.cells = [...document.querySelectorAll('table.timeline td')].map(
      c => [c.className, c.textContent]);
  out.notes = [...document.querySelectorAll('table.ranks td:last-child')].map(
      c => Math.round(box(c).right));
  document.body.setAttribute('data-measure', JSON.stringify(out));
})();
</script>"""


def _measure(page: Path, width: int = 1280) -> dict:
    probe = page.with_name("measured.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    assert CHROMIUM is not None
    proc = subprocess.Popen(  # its own group: Chromium's helpers end with it
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={page.parent / 'chromium'}", f"--window-size={width},900",
         "--dump-dom", probe.as_uri()],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    m = re.search(r'data-measure="([^"]*)"', out)
    assert m, out[-2000:]
    return json.loads(html.unescape(m.group(1)))


def _report(run: Path, page: Path) -> Path:
    got = run_cli("analyze", str(run), "--html", str(page), timeout=90)
    assert page.exists(), got.stdout + got.stderr
    return page


def test_an_aborted_ranks_page_fits_1280_px_and_shows_unknown_as_unknown(fixtures, tmp_path):
    """FSDP2, an expert skipped: gloo aborted one rank; its recorder was saved before its
    last collectives, which the survivor's history and its own counts place. The page fits
    the window (no horizontal scrollbar: the rank table's note column in view), the grid and
    its cells inside, and those seqs are "?" (unknown), not the red "never posted" dash."""
    run = relocated(fixtures / "fsdp2_moe_skip_abort_2", tmp_path / "run",
                    "/work/main/runs/fuzz-31415/jobs", str(fixtures / "fsdp2_moe_skip_jobs"))
    m = _measure(_report(run, tmp_path / "report.html"))
    assert m["page"] <= m["view"] == 1280, m
    for t in m["tables"]:
        assert t["right"] <= t["inside"] or t["scrolls"], t  # in view, or scrolls in its box
    assert m["notes"] and max(m["notes"]) <= 1280, m["notes"]
    # rank 2's row: its recorder was saved at an earlier seq; it posted seq 52 (gloo
    # aborted it there), so seqs 46-51 were posted too: "?", never the red dash
    width = len(m["cells"]) // 4
    row2 = m["cells"][2 * width:3 * width]
    assert [text for _c, text in row2[:-1]] == ["?"] * (width - 1), row2
    assert all(c.startswith("unknown") for c, _text in row2[:-1]), row2


def test_the_heat_map_sits_beside_the_grid(tmp_path):
    """A page with the grid and the token heat map (a routing report): side by side at
    1280 px, each inside the page."""
    from moe_hang.analysis.diagnosis import (
        Diagnosis,
        Divergence,
        MismatchKind,
        Timeline,
        TimelineCell,
        Verdict,
    )
    from moe_hang.analysis.routing import ExpertGap, RoutingReport
    from moe_hang.report.html import to_html
    from moe_hang.report.words import ReportContext

    seqs = list(range(100, 125))
    cells: dict[int, list[TimelineCell | None]] = {
        r: [TimelineCell("all_gather", [[1024, 64]], "done") for _ in seqs] for r in (0, 1)}
    cells[1][-6:] = [TimelineCell("?", [], "unknown")] * 6
    d = Diagnosis(verdict=Verdict.DESYNC, summary="x", culprit_ranks=[1],
                  first_divergence=Divergence(pg="0", seq=119, kind=MismatchKind.MISSING),
                  timeline=Timeline(pg="0", pg_desc="default_pg", seqs=seqs, highlight=119,
                                    ranks=cells),
                  routing=RoutingReport(2, [ExpertGap(2, "model.layers.1.block_sparse_moe", 2, 2,
                                                      {0: 5, 1: 0}, {0: 24, 1: 24})],
                                        counts={r: {f"model.layers.{b}.block_sparse_moe":
                                                    [5, 7, 5 * (1 - r), 7 + 5 * r]
                                                    for b in (0, 1)} for r in (0, 1)}))
    page = tmp_path / "report.html"
    page.write_text(to_html(d, ReportContext("watch", "moe-hang watch"), page))
    m = _measure(page)
    assert m["page"] <= 1280, m
    grid = next(t for t in m["tables"] if t["cls"] == "timeline")
    heat = next(t for t in m["tables"] if t["cls"] == "heat")
    assert abs(grid["top"] - heat["top"]) < 60, (grid, heat)  # beside, not below
    assert heat["right"] <= heat["inside"] and not heat["scrolls"], heat  # all of it in view
    assert grid["scrolls"], grid  # the 25 seqs scroll in the grid's own box
    assert sum(text == "?" for c, text in m["cells"] if "unknown" in c) == 6
