"""docs/_ext/execution.py: pages executed a few at a time into a jupyter-cache, in real kernels."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

import execution  # docs/_ext, put on sys.path by conftest


def _page(folder, name: str, body: str):
    """A py:percent page that appends (name, start, end) to times.jsonl after running body."""
    page = folder / f"{name}.py"
    page.write_text(f"""# %%
import json, time
start = time.time()
{body}
with open("times.jsonl", "a") as log:
    log.write(json.dumps([{name!r}, start, time.time()]) + "\\n")
""")
    return page


def _intervals(folder) -> dict[str, tuple[float, float]]:
    lines = (folder / "times.jsonl").read_text().splitlines()
    return {name: (start, end) for name, start, end in map(json.loads, lines)}


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_pages_run_two_at_a_time_and_one_that_must_run_alone_runs_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "ALONE", {"alone"})
    pages = [_page(tmp_path, name, "time.sleep(2)") for name in ("alone", "first", "second", "third")]
    with execution.Execution(tmp_path / "cache", workers=2) as run:
        futures = run.submit_all(execution.execution_order(pages, {}))
    assert all(future.result().cells[0].cell_type == "code" for future in futures.values())
    times = _intervals(tmp_path)
    others = ("first", "second", "third")
    assert not any(_overlap(times["alone"], times[name]) for name in others)
    # first, as submitted: the second worker did not start a page while the first started the alone one
    assert times["alone"][1] <= min(times[name][0] for name in others)
    assert any(_overlap(times[a], times[b]) for a in others for b in others if a < b)  # two workers: two at once


def test_a_page_that_must_run_alone_waits_for_the_pages_submitted_before_it_and_one_worker_runs_them_all(
        tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "ALONE", {"alone"})
    pages = [_page(tmp_path, name, "time.sleep(1)") for name in ("before", "alone", "after")]
    with execution.Execution(tmp_path / "cache", workers=1) as run:
        futures = run.submit_all(pages)  # not in execution_order: an ordinary page ahead of the alone one
        assert all(future.result(timeout=120).cells for future in futures.values())
    times = _intervals(tmp_path)
    assert times["before"][1] <= times["alone"][0] and times["alone"][1] <= times["after"][0]


def test_a_page_in_the_cache_is_not_executed_again_and_a_failing_page_says_what_failed(tmp_path):
    page = _page(tmp_path, "once", "print('executed')")
    failing = _page(tmp_path, "failing", "raise ValueError('the cell that fails')")
    with execution.Execution(tmp_path / "cache") as run:
        assert run.submit(page).result().cells[0].outputs[0].text == "executed\n"
        with pytest.raises(execution.PageFailed, match="ValueError: the cell that fails"):
            run.submit(failing).result()
    with execution.Execution(tmp_path / "cache") as run:  # a new run over the same cache
        assert run.submit(page).result().cells[0].outputs[0].text == "executed\n"
    assert list(_intervals(tmp_path)) == ["once"]  # the second run took it from the cache


def test_the_pages_with_a_recorded_time_run_longest_first_after_those_that_run_alone():
    pages = [ROOT / "tutorials" / f"{stem}.py" for stem in ("quickstart", "communication", "compile", "new_page")]
    order = execution.execution_order(pages, {"quickstart": 10.0, "communication": 20.0, "compile": 50.0})
    assert [page.stem for page in order] == ["communication", "new_page", "compile", "quickstart"]


def test_a_page_whose_rendezvous_failed_in_gloo_is_executed_once_more_and_only_once(tmp_path):
    fails_once = _page(tmp_path, "fails_once", f"""import os
if not os.path.exists("tried"):
    open("tried", "w").close()
    raise RuntimeError("{execution.TRANSIENT} with [pair.cc:547] Connection closed by peer")""")
    always = _page(tmp_path, "always", f"""open("attempts", "a").write("x")
raise RuntimeError("{execution.TRANSIENT} with [pair.cc:547] Connection closed by peer")""")
    with execution.Execution(tmp_path / "cache") as run:
        run.submit(fails_once).result()
        with pytest.raises(execution.PageFailed, match="connectFullMesh"):
            run.submit(always).result()
    assert list(_intervals(tmp_path)) == ["fails_once"]
    assert (tmp_path / "attempts").read_text() == "xx"
