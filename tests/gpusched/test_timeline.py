"""The HTML timeline: valid, self-contained, one bar per file that ran, coloured by outcome."""

from __future__ import annotations

import json
import subprocess
import sys

import html5lib
from deadlines import hang_guard

from gpusched.reporting.timeline import COLOURS, cpu_lanes, timeline_html
from gpusched.results import FileResult, Outcome

SVG = "{http://www.w3.org/2000/svg}"
HTML = "{http://www.w3.org/1999/xhtml}"


def parse(page: str):
    """Parse strictly: any HTML parse error raises."""
    return html5lib.HTMLParser(strict=True, namespaceHTMLElements=True).parse(page)


def bars(tree) -> list:
    return [g for g in tree.iter(f"{SVG}g") if g.get("class") == "bar"]


def test_cpu_lanes_are_the_fewest_without_overlap():
    results = [
        FileResult("a", Outcome.PASSED, (), 0.0, 4.0),
        FileResult("b", Outcome.PASSED, (), 1.0, 2.0),
        FileResult("g", Outcome.PASSED, ("0",), 0.0, 9.0),  # a GPU file takes no CPU lane
        FileResult("c", Outcome.PASSED, (), 2.0, 5.0),  # b's lane is free again at 2.0
        FileResult("d", Outcome.PASSED, (), 3.0, 6.0),
        FileResult("s", Outcome.SKIPPED),
    ]
    assert cpu_lanes(results) == {0: 0, 1: 1, 3: 1, 4: 2}


RESULTS = [
    FileResult("/r/tests/test_pair.py", Outcome.PASSED, ("0", "1"), 0.0, 5.0),
    FileResult("/r/tests/test_fail.py", Outcome.FAILED, ("2",), 0.5, 3.0),
    FileResult(
        "/r/tests/test_spread.py", Outcome.TIMEOUT, ("0", "2"), 5.0, 9.0, message="timed out"
    ),
    FileResult("/r/tests/test_cpu1.py", Outcome.PASSED, (), 0.0, 2.0),
    FileResult("/r/tests/test_cpu2.py", Outcome.CRASHED, (), 1.0, 4.0),
    FileResult('/r/tests/test_<odd>&"name".py', Outcome.FLAKY, (), 2.5, 3.5, attempts=2),
    FileResult("/r/tests/test_big.py", Outcome.SKIPPED, message="needs 8 GPUs, 4 available"),
]


def test_page_is_valid_html_with_one_bar_per_file_that_ran():
    page = timeline_html(RESULTS, cards=["0", "1", "2", "3"])
    tree = parse(page)
    drawn = bars(tree)
    assert len(drawn) == 6  # every file but the skipped one
    by_file = {g.get("data-file").rsplit("/", 1)[-1]: g for g in drawn}
    assert set(by_file) == {
        "test_pair.py",
        "test_fail.py",
        "test_spread.py",
        "test_cpu1.py",
        "test_cpu2.py",
        'test_<odd>&"name".py',
    }
    for result in RESULTS[:-1]:
        bar = by_file[result.path.rsplit("/", 1)[-1]]
        rects = bar.findall(f"{SVG}rect")
        assert {rect.get("fill") for rect in rects} == {COLOURS[result.outcome]}
        hover = bar.find(f"{SVG}title").text
        assert result.path.rsplit("/", 1)[-1] in hover and result.outcome.value in hover
        assert f"{result.duration:.1f}s" in hover
    # Cards 0 and 2 are not adjacent rows: one bar in two pieces; 0,1 is one piece.
    assert len(by_file["test_spread.py"].findall(f"{SVG}rect")) == 2
    assert len(by_file["test_pair.py"].findall(f"{SVG}rect")) == 1
    assert by_file["test_spread.py"].get("data-cards") == "gpu 0,2"
    assert (
        "gpu 0,2 | 4.0s | TIMEOUT | timed out" in by_file["test_spread.py"].find(f"{SVG}title").text
    )
    labels = [t.text for t in tree.iter(f"{SVG}text") if t.get("class") == "label"]
    assert labels == ["gpu 0", "gpu 1", "gpu 2", "gpu 3", "cpu 1", "cpu 2"]  # idle card 3 too
    skipped = "".join(tree.find(f".//{HTML}table").itertext())
    assert "test_big.py" in skipped and "needs 8 GPUs, 4 available" in skipped


def test_page_loads_nothing_from_elsewhere():
    tree = parse(timeline_html(RESULTS))
    for element in tree.iter():
        for attribute in ("src", "href", "{http://www.w3.org/1999/xlink}href"):
            assert element.get(attribute) is None, (element.tag, attribute)
        assert element.tag not in (f"{HTML}link", f"{HTML}iframe", f"{HTML}img")
    scripts = list(tree.iter(f"{HTML}script"))
    assert len(scripts) == 1 and scripts[0].text.strip()  # inline only


def test_an_empty_run_still_gives_a_valid_page():
    assert bars(parse(timeline_html([]))) == []


def test_gpusched_run_writes_the_timeline(tmp_path):
    for name, gpus in (("test_a.py", 2), ("test_b.py", 1), ("test_c.py", 0)):
        marker = f"pytestmark = pytest.mark.gpu({gpus})\n" if gpus else ""
        (tmp_path / name).write_text(
            f"import pytest\n{marker}def test_x():\n    pass\n", encoding="utf-8"
        )
    done = subprocess.run(
        [sys.executable, "-m", "gpusched", "run", ".", "--simulate-gpus", "2",
         "--timeline", "out/t.html", "--json", "r.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(120),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    drawn = bars(parse((tmp_path / "out" / "t.html").read_text(encoding="utf-8")))
    assert sorted(g.get("data-file") for g in drawn) == ["test_a.py", "test_b.py", "test_c.py"]
    cards = {f["path"].rsplit("/", 1)[-1]: ",".join(f["cards"]) for f in report["files"]}
    for g in drawn:
        expected = cards[g.get("data-file")]
        assert g.get("data-cards") == ("gpu " + expected if expected else "cpu")


def test_timeline_without_a_path_is_a_usage_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gpusched", "run", ".", "--timeline"],
        cwd=tmp_path, capture_output=True, text=True, timeout=hang_guard(60),
    )  # fmt: skip
    assert done.returncode == 4
    assert "--timeline: expected one argument" in done.stderr
