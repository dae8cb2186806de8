"""The timeline of a run as one self-contained HTML page: a Gantt chart of cards over time.

One row per card and per CPU lane, one bar per file that ran (a file on several
cards is one bar spanning their rows, in pieces where the rows are not
adjacent), coloured by outcome, with a hover showing the file, cards, duration
and outcome. Files that never ran (skipped, not run, collection errors) are
listed below the chart. The page loads nothing from the network: inline SVG,
CSS and a few lines of script. Built by ``timeline_html`` from the results alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

from gpusched.reporting.report import display_path, format_place
from gpusched.results import FileResult, Outcome

COLOURS = {
    Outcome.PASSED: "#3a9d5d",
    Outcome.FLAKY: "#e0a526",
    Outcome.FAILED: "#d64545",
    Outcome.ERROR: "#8e44ad",
    Outcome.TIMEOUT: "#a52a2a",
    Outcome.CRASHED: "#c0398f",
    Outcome.INTERRUPTED: "#7f8c8d",
    Outcome.SKIPPED: "#5dade2",
    Outcome.NOT_RUN: "#bdc3c7",
}

WIDTH, LABEL, ROW, TOP = 1100, 70, 26, 30


def ran(result: FileResult) -> bool:
    """Whether the file has a place on the chart (it started and took time)."""
    return result.end > result.start


def cpu_lanes(results: Sequence[FileResult]) -> dict[int, int]:
    """Lane number (0-based) for each CPU file, by index in ``results``: the fewest lanes
    such that files in one lane never overlap (earliest start first, first free lane)."""
    order = sorted(
        (i for i, r in enumerate(results) if not r.cards and ran(r)),
        key=lambda i: (results[i].start, i),
    )
    lane_end: list[float] = []
    lanes: dict[int, int] = {}
    for i in order:
        result = results[i]
        free = next((n for n, end in enumerate(lane_end) if end <= result.start + 1e-9), None)
        if free is None:
            free = len(lane_end)
            lane_end.append(0.0)
        lane_end[free] = result.end
        lanes[i] = free
    return lanes


def _card_key(card: str) -> tuple[int, int | str]:
    return (0, int(card)) if card.isdigit() else (1, card)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive row numbers as (first, count) pieces."""
    pieces: list[tuple[int, int]] = []
    for row in sorted(rows):
        if pieces and pieces[-1][0] + pieces[-1][1] == row:
            pieces[-1] = (pieces[-1][0], pieces[-1][1] + 1)
        else:
            pieces.append((row, 1))
    return pieces


def _tick_step(span: float) -> float:
    raw = span / 10
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def layout(
    results: Sequence[FileResult],
    cards: Sequence[str] = (),
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[str], dict[int, list[int]], int, int]:
    """Row labels, the rows of each drawn result (by index), and the card and CPU lane counts.

    On one machine: one row per card, then the CPU lanes. In a cluster run
    (``nodes``: each node's card ids, or results that carry a node) the rows are
    grouped by node, each node's cards then its CPU lanes.
    """
    groups: dict[str, list[str]] = {name: list(ids) for name, ids in (nodes or {}).items()}
    for r in results:
        if r.node or groups:
            groups.setdefault(r.node, [])
    if not groups:
        groups = {"": list(cards)}
    labels: list[str] = []
    rows: dict[int, list[int]] = {}
    card_total = lane_total = 0
    for node, node_cards in groups.items():
        mine = [i for i, r in enumerate(results) if r.node == node]
        card_ids = sorted(
            {*node_cards, *(c for i in mine for c in results[i].cards)}, key=_card_key
        )
        lanes = cpu_lanes([results[i] for i in mine])
        lane_count = max(lanes.values(), default=-1) + 1
        prefix = f"{node} " if node else ""
        first = len(labels)
        labels += [f"{prefix}gpu {card}" for card in card_ids]
        labels += [f"{prefix}cpu {n + 1}" for n in range(lane_count)]
        row_of = {card: first + n for n, card in enumerate(card_ids)}
        for local, i in enumerate(mine):
            result = results[i]
            if ran(result):
                rows[i] = (
                    [row_of[c] for c in result.cards]
                    if result.cards
                    else [first + len(card_ids) + lanes[local]]
                )
        card_total += len(card_ids)
        lane_total += lane_count
    return labels, rows, card_total, lane_total


def timeline_html(
    results: Sequence[FileResult],
    cards: Sequence[str] = (),
    title: str = "gpusched timeline",
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> str:
    """The page for these results; ``cards`` (or each node's, in ``nodes``) adds idle cards' rows."""
    labels, row_map, card_count, lane_count = layout(results, cards, nodes)
    label_width = max(LABEL, 7 * max((len(label) for label in labels), default=0) + 16)
    span = max((r.end for r in results if ran(r)), default=0.0) or 1.0
    scale = (WIDTH - label_width - 20) / span
    height = TOP + ROW * max(1, len(labels)) + 30

    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">'
    ]
    for n, label in enumerate(labels):
        y = TOP + n * ROW
        shade = "#f4f6f7" if n % 2 == 0 else "#ffffff"
        svg.append(
            f'<rect class="lane" x="{label_width}" y="{y}" width="{WIDTH - label_width - 20}" '
            f'height="{ROW}" fill="{shade}"/>'
        )
        svg.append(
            f'<text class="label" x="{label_width - 8}" y="{y + ROW / 2 + 4}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
    step = _tick_step(span)
    tick = 0.0
    bottom = TOP + ROW * max(1, len(labels))
    while tick <= span + 1e-9:
        x = label_width + tick * scale
        svg.append(
            f'<line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" y2="{bottom}" class="grid"/>'
            f'<text class="tick" x="{x:.1f}" y="{TOP - 8}" text-anchor="middle">{tick:g}s</text>'
        )
        tick += step
    for i, result in enumerate(results):
        if not ran(result):
            continue
        rows = row_map[i]
        path = display_path(result.path)
        detail = (
            f"{path}\n{format_place(result.cards, result.node)} | {result.duration:.1f}s | "
            f"{result.outcome.value}"
            + (f" | {result.message}" if result.message else "")
            + (f" | attempt {result.attempts}" if result.attempts > 1 else "")
        )
        x = label_width + result.start * scale
        width = max(1.5, result.duration * scale)
        colour = COLOURS.get(result.outcome, "#999999")
        svg.append(
            f'<g class="bar" data-file="{escape(path)}" '
            f'data-cards="{escape(format_place(result.cards, result.node))}" '
            f'data-duration="{result.duration:.1f}s" data-outcome="{escape(result.outcome.value)}">'
            f"<title>{escape(detail)}</title>"
        )
        for first, count in _runs(rows):
            y = TOP + first * ROW + 2
            svg.append(
                f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{count * ROW - 4}" '
                f'rx="3" fill="{colour}"/>'
            )
        name = path.rsplit("/", 1)[-1]
        if width > 7 * len(name) + 8:
            y = TOP + min(rows) * ROW + ROW / 2 + 4
            svg.append(f'<text class="name" x="{x + 4:.1f}" y="{y}">{escape(name)}</text>')
        svg.append("</g>")
    svg.append("</svg>")

    shown = sorted({r.outcome for r in results}, key=list(COLOURS).index)
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{COLOURS[o]}"></span>'
        f"{escape(o.value)}</span>"
        for o in shown
    )
    idle = [r for r in results if not ran(r)]
    idle_rows = "".join(
        f"<tr><td>{escape(r.outcome.value)}</td><td>{escape(display_path(r.path))}</td>"
        f"<td>{escape(r.message)}</td></tr>"
        for r in idle
    )
    idle_table = (
        f"<h2>Files that did not run ({len(idle)})</h2><table><tr><th>outcome</th>"
        f"<th>file</th><th>reason</th></tr>{idle_rows}</table>"
        if idle
        else ""
    )
    drawn = sum(1 for r in results if ran(r))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px; }}
h2 {{ font-size: 15px; margin: 18px 0 6px; }}
.meta {{ color: #555; font-size: 13px; margin-bottom: 8px; }}
.key {{ margin-right: 14px; font-size: 13px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -1px; border-radius: 2px; }}
svg text {{ font-size: 12px; fill: #333; }}
svg text.name {{ fill: #fff; pointer-events: none; }}
svg .grid {{ stroke: #d5d8dc; stroke-width: 1; }}
svg .bar rect {{ stroke: #fff; stroke-width: 0.5; }}
svg .bar:hover rect {{ stroke: #000; stroke-width: 1.5; }}
#tip {{ position: fixed; display: none; background: #222; color: #fff; padding: 6px 8px;
  border-radius: 4px; font-size: 12px; pointer-events: none; white-space: pre; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; }}
</style>
</head>
<body>
<h1>{escape(title)}</h1>
<div class="meta">{drawn} files on {card_count} cards and {lane_count} CPU lanes,
makespan {span if drawn else 0.0:.1f}s</div>
<div class="legend">{legend}</div>
{"".join(svg)}
{idle_table}
<div id="tip"></div>
<script>
(function () {{
  var tip = document.getElementById("tip");
  document.querySelectorAll("g.bar").forEach(function (bar) {{
    bar.addEventListener("mousemove", function (event) {{
      var d = bar.dataset;
      tip.textContent = d.file + "\\n" + d.cards + "  " + d.duration + "  " + d.outcome;
      tip.style.left = (event.clientX + 12) + "px";
      tip.style.top = (event.clientY + 12) + "px";
      tip.style.display = "block";
    }});
    bar.addEventListener("mouseleave", function () {{ tip.style.display = "none"; }});
  }});
}})();
</script>
</body>
</html>
"""
