"""The charts of ``trainsnap.tools.plot``: the PNG decodes and shows its axes, ticks, legend,
marks and title where they belong; every character a chart draws has a glyph; the terminal chart
still works."""

from __future__ import annotations

import io
import math
import string
import struct
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from trainsnap.tools import demo, font, plot
from trainsnap.tools.plot import COLOURS, Mark, png_chart, text_chart, ticks

RGB = tuple[int, int, int]


class Image:
    """A PNG read back with nothing but zlib and struct (8-bit RGB, filter 0: what we write)."""

    def __init__(self, data: bytes) -> None:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        pos, idat, self.tags = 8, b"", []
        while pos < len(data):
            (length,) = struct.unpack(">I", data[pos : pos + 4])
            tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
            (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
            assert crc == zlib.crc32(tag + body), tag
            self.tags.append(tag)
            if tag == b"IHDR":
                self.width, self.height, depth, kind, *_ = struct.unpack(">IIBBBBB", body)
                assert (depth, kind) == (8, 2)
            elif tag == b"IDAT":
                idat += body
            pos += 12 + length
        raw = zlib.decompress(idat)
        stride = self.width * 3 + 1
        assert len(raw) == stride * self.height
        assert all(raw[r * stride] == 0 for r in range(self.height))
        self.rows = [raw[r * stride + 1 : (r + 1) * stride] for r in range(self.height)]

    def pixel(self, x: int, y: int) -> RGB:
        row = self.rows[y]
        return (row[3 * x], row[3 * x + 1], row[3 * x + 2])

    def colours(self, xs: Iterable[int], ys: Iterable[int]) -> set[RGB]:
        xs = list(xs)
        return {self.pixel(x, y) for y in ys for x in xs}

    def count(self, colour: RGB, xs: Iterable[int], ys: Iterable[int]) -> int:
        xs = list(xs)
        return sum(self.pixel(x, y) == colour for y in ys for x in xs)


REF = [(s, 5.0 * math.exp(-s / 20) + 1.0) for s in range(60)]
RUN = REF[:41] + [(s, loss * (1 + 1e-6)) for s, loss in REF[41:]]
MARKS = [Mark(40, "crash at step 40", "red"), Mark(30, "resume from step 30 on dp=2 tp=1", "green")]


@pytest.fixture
def chart(tmp_path: Path) -> Image:
    out = png_chart(
        [("reference run", REF, "blue"), ("crashed + resumed run", RUN, "orange")],
        tmp_path / "chart.png",
        title="a title",
        x_label="step",
        y_label="loss",
        marks=MARKS,
        width=900,
        height=500,
    )
    return Image(out.read_bytes())


def axes(image: Image) -> tuple[int, int, int]:
    """(x of the left axis, y of its top, y of the bottom axis): the column and the row with the
    most axis-coloured pixels (the last of the axes' two, which is where the data's edge is)."""
    cols = {x: image.count(plot._AXIS, [x], range(image.height)) for x in range(image.width)}
    rows = {y: image.count(plot._AXIS, range(image.width), [y]) for y in range(image.height)}
    left = max(cols, key=lambda x: (cols[x], x))
    bottom = max(rows, key=lambda y: (rows[y], y))
    top = min(y for y in range(image.height) if image.pixel(left, y) == plot._AXIS)
    return left, top, bottom


def test_png_decodes_with_its_size(chart: Image) -> None:
    assert (chart.width, chart.height) == (900, 500)
    assert chart.tags == [b"IHDR", b"IDAT", b"IEND"]


def test_png_has_axes_curves_ticks_legend_marks_and_title(chart: Image) -> None:
    left, top, bottom = axes(chart)
    assert 40 < left < 200 and 60 < top < bottom < chart.height - 40
    blue, orange, red, green = (COLOURS[c] for c in ("blue", "orange", "red", "green"))
    inside = chart.colours(range(left + 2, chart.width), range(top, bottom - 1))
    assert {blue, orange, red, green} <= inside, "the curves and the marks' lines"
    # Curves stay inside the axes: what is above them in their colours is the legend.
    legend = chart.colours(range(chart.width), range(top))
    assert {blue, orange} <= legend
    for colour in (red, green):  # a label's text, not just the top of its dashed line
        assert chart.count(colour, range(chart.width), range(top)) > 100
    text = plot._TEXT
    assert chart.count(text, range(chart.width), range(16, 30)) > 50, "the title"
    y_ticks = range(left - 10 - 60, left - 8)
    assert chart.count(text, y_ticks, range(top, bottom)) > 100, "y tick values"
    assert chart.count(text, range(left, chart.width), range(bottom + 8, bottom + 30)) > 100
    assert chart.count(text, range(16, 32), range(top, bottom)) > 20, "the y axis label"
    assert chart.count(text, range(left, chart.width), range(chart.height - 32, chart.height)) > 20


def test_tick_values_are_drawn_in_the_font(tmp_path: Path) -> None:
    """The x tick value "0" sits under the axis' first tick, glyph for glyph."""
    image = Image(png_chart([("a", [(0, 0), (10, 1)], "blue")], tmp_path / "t.png").read_bytes())
    left, _top, bottom = axes(image)
    x0, y0 = left + 10 - font.WIDTH * plot._SCALE // 2, bottom + 12  # the frame's 10 px inset
    drawn = [
        "".join(
            "#" if image.pixel(x0 + c * plot._SCALE, y0 + r * plot._SCALE) == plot._TEXT else "."
            for c in range(font.WIDTH)
        )
        for r in range(font.HEIGHT)
    ]
    assert tuple(drawn) == font.glyph("0")


def test_marks_labels_do_not_overlap_or_cross_lines() -> None:
    xs, widths = [500, 640, 660], [400, 200, 100]
    spots = plot._place_labels(xs, widths, left=100, right=940)
    boxes = [(row, start, start + w) for (row, start), w in zip(spots, widths, strict=True)]
    for i, (row, start, end) in enumerate(boxes):
        assert start >= 100 and end <= 940
        for j, (other_row, other_start, other_end) in enumerate(boxes):
            if i != j and row == other_row:
                assert end <= other_start or other_end <= start
            if i != j and other_row < row:
                assert not start <= xs[j] <= end, "a line from a higher label crosses this one"


def test_every_character_the_demo_charts_has_a_glyph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Path:
        calls.append({"series": args[0], **kwargs})
        return png_chart(*args, **kwargs)

    monkeypatch.setattr(demo, "png_chart", recording)
    ref, crash = demo.Phase("reference", 2, 2, "r"), demo.Phase("crashed", 2, 2, "c", crash_at=40)
    resume = demo.Phase("resumed", 2, 1, "c")
    ref.rows = [{"event": "step", "step": s, "loss": loss} for s, loss in REF]
    crash.rows, resume.rows = ref.rows[:41], ref.rows[31:]
    console = Console(file=io.StringIO())
    demo._charts(console, ref, crash, resume, 30, str(tmp_path / "demo.png"))
    (call,) = calls
    used = "".join(
        [call["title"], call["x_label"], call["y_label"], string.digits, ".-"]
        + [name for name, _pts, _colour in call["series"]]
        + [mark.label for mark in call["marks"]]
    )
    assert set(used) <= set(font.GLYPHS)
    assert {mark.label for mark in call["marks"]} == {
        "crash at step 40",
        "resume from step 30 on dp=2 tp=1",
    }
    assert Image((tmp_path / "demo.png").read_bytes()).width > 0


def test_font_covers_printable_ascii_in_5_columns() -> None:
    assert set(string.printable[:95]) == set(font.GLYPHS)
    for ch, rows in font.GLYPHS.items():
        assert len(rows) in (font.HEIGHT, font.HEIGHT + font.DESCENT), ch
        assert all(len(row) == font.WIDTH and set(row) <= {".", "#"} for row in rows), ch
    assert font.glyph("é") == font.glyph("?")
    assert font.text_width("ab", 2) == 22


@pytest.mark.parametrize(
    ("lo", "hi", "want"),
    [
        (0, 59, ["0", "10", "20", "30", "40", "50"]),
        (0, 23, ["0", "5", "10", "15", "20"]),
        (2.17, 2.19, ["2.170", "2.175", "2.180", "2.185", "2.190"]),
        (-0.3, 0.2, ["-0.3", "-0.2", "-0.1", "0.0", "0.1", "0.2"]),
    ],
)
def test_ticks_are_round_values_in_range(lo: float, hi: float, want: list[str]) -> None:
    got = ticks(lo, hi)
    assert [label for _, label in got] == want
    assert all(lo - 1e-9 <= value <= hi + 1e-9 for value, _ in got)


def test_colours_by_name_or_hex_and_unknown_ones_refused() -> None:
    assert plot.rgb("#0a0b0c") == (10, 11, 12)
    assert plot.rgb("blue") == COLOURS["blue"]
    with pytest.raises(ValueError, match="unknown colour 'teal'"):
        plot.rgb("teal")


def test_empty_chart_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to chart"):
        png_chart([("a", [], "blue")], tmp_path / "x.png")


def test_text_chart_draws_both_series_marks_and_legend() -> None:
    out = text_chart([("ref", REF, "."), ("run", RUN, "*")], width=60, height=12, marks=(30, 40))
    lines = out.splitlines()
    assert len(lines) == 12 + 2
    grid = [line[8:] for line in lines[:12]]
    assert all(len(row) == 60 for row in grid)
    assert sum(row.count("|") for row in grid) > 12, "two vertical marks"
    assert any("#" in row for row in grid), "equal curves drawn over each other"
    low = min(loss for _, loss in REF)
    assert lines[0].startswith("  6.000") and lines[11].startswith(f"{low:7.3f}")
    assert ". ref" in lines[-1] and "* run" in lines[-1] and "| crash / resume" in lines[-1]


def test_label_placement_does_not_grow_with_the_cube_of_the_marks() -> None:
    """Why: each label tried a row per mark against every placed label: O(marks^3), minutes for
    a restart log of a few thousand runs. Rows are now bounded and a label that fits nowhere is
    left out, so the work is bounded by what fits on the chart."""
    xs = [100 + (i * 7) % 840 for i in range(3000)]
    started = time.monotonic()
    spots = plot._place_labels(xs, [150] * len(xs), left=100, right=940)
    assert time.monotonic() - started < 30  # the old placement: hours
    placed = [s for s in spots if s is not None]
    assert placed and max(row for row, _ in placed) < plot.MAX_LABEL_ROWS
    assert len(placed) <= plot.MAX_LABEL_ROWS * 840 // 150  # the rows' width bounds them
