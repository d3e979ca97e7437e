"""Small line charts without a plotting library: a terminal chart and a PNG file.

The demo shows its loss curves with them, and any command that charts a run can: the PNG chart
takes named, coloured series, labelled vertical marks (a crash, a resume), a title and axis
labels. It is drawn into an RGB buffer -- lines, rectangles and text in the 5x7 font of
:mod:`trainsnap.tools.font`, no anti-aliasing -- and encoded with zlib, which is all the PNG
format needs.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainsnap.tools import font

Series = tuple[str, Sequence[tuple[float, float]], str]
"""(name, points (x, y), marker character for the terminal / colour for the PNG)."""

RGB = tuple[int, int, int]

COLOURS: dict[str, RGB] = {
    "blue": (40, 90, 200),
    "orange": (235, 125, 20),
    "red": (200, 35, 35),
    "green": (30, 140, 60),
    "purple": (120, 60, 170),
    "grey": (120, 120, 120),
    "black": (30, 30, 30),
}
"""The colour names a series or a mark may use; ``#rrggbb`` works too."""

_TEXT: RGB = (30, 30, 30)
_AXIS: RGB = (95, 95, 95)
_GRID: RGB = (232, 232, 232)
_SCALE = 2
"""Text is drawn at twice the font's size: 10x14 pixels a glyph."""
_LINE = (font.HEIGHT + font.DESCENT) * _SCALE + 4
"""Height of one row of text, descenders and spacing included."""
_MARGIN = 16


@dataclass(frozen=True, slots=True)
class Mark:
    """A vertical line across a PNG chart at ``x``, with its label above the chart."""

    x: float
    label: str = ""
    colour: str = "grey"


def rgb(colour: str) -> RGB:
    """A colour name of :data:`COLOURS` or ``#rrggbb`` as an (r, g, b) triple."""
    if colour in COLOURS:
        return COLOURS[colour]
    if len(colour) == 7 and colour.startswith("#"):
        try:
            return (int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16))
        except ValueError:
            pass
    raise ValueError(f"unknown colour {colour!r}: use #rrggbb or one of {', '.join(COLOURS)}")


def _bounds(series: Sequence[Series]) -> tuple[float, float, float, float]:
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    if not xs:
        raise ValueError("nothing to chart: every series is empty")
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    return x0, x1, y0, y1


def text_chart(
    series: Sequence[Series], *, width: int = 72, height: int = 16, marks: Sequence[float] = ()
) -> str:
    """The series on a character grid (later series drawn over earlier ones); ``marks`` are
    x positions drawn as vertical bars (a crash, a resume)."""
    x0, x1, y0, y1 = _bounds(series)
    grid = [[" "] * width for _ in range(height)]

    def col(x: float) -> int:
        return min(width - 1, max(0, round((x - x0) / (x1 - x0) * (width - 1))))

    def row(y: float) -> int:
        return min(height - 1, max(0, round((y1 - y) / (y1 - y0) * (height - 1))))

    for x in marks:
        for r in range(height):
            grid[r][col(x)] = "|"
    drawn: set[str] = set()
    for _label, pts, ch in series:
        for x, y in pts:
            r, c = row(y), col(x)
            # A cell another series already drew is shown as "#": both curves pass there.
            grid[r][c] = "#" if grid[r][c] in drawn and grid[r][c] != ch else ch
        drawn.add(ch)
    lines = []
    for r, cells in enumerate(grid):
        y = y1 - r * (y1 - y0) / (height - 1)
        label = f"{y:7.3f} " if r in (0, height // 2, height - 1) else " " * 8
        lines.append(label + "".join(cells))
    lines.append(" " * 8 + f"{x0:<10g}" + " " * max(0, width - 20) + f"{x1:>10g}")
    legend = "   ".join(f"{ch} {label}" for label, _pts, ch in series) + "   # both"
    return "\n".join([*lines, " " * 8 + legend + ("   | crash / resume" if marks else "")])


def ticks(lo: float, hi: float, count: int = 6) -> list[tuple[float, str]]:
    """About ``count`` round positions in [lo, hi] (steps of 1, 2, 2.5 or 5 times a power of
    ten), each with its label, all labels with the same number of decimals."""
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if step / magnitude == 2.5 else 0))
    out: list[tuple[float, str]] = []
    k = math.ceil(lo / step - 1e-9)
    while k * step <= hi + step * 1e-9:
        out.append((k * step, f"{k * step + 0.0:.{decimals}f}"))
        k += 1
    return out


class _Canvas:
    """An RGB pixel buffer with the few drawing operations a chart needs, and its PNG."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def fill(self, x0: int, y0: int, x1: int, y1: int, colour: RGB) -> None:
        """Paint the rectangle [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        if x0 >= x1:
            return
        span = bytes(colour) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            i = (y * self.width + x0) * 3
            self.pixels[i : i + len(span)] = span

    def line(
        self, a: tuple[int, int], b: tuple[int, int], colour: RGB, thickness: int = 1, dash: int = 0
    ) -> None:
        """A straight line of square dots ``thickness`` wide; ``dash`` > 0 draws that many
        pixels on, then as many off."""
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        half = thickness // 2
        for k in range(n + 1):
            if dash and (k // dash) % 2:
                continue
            x = a[0] + round((b[0] - a[0]) * k / n) - half
            y = a[1] + round((b[1] - a[1]) * k / n) - half
            self.fill(x, y, x + thickness, y + thickness, colour)

    def text(
        self, x: int, y: int, text: str, colour: RGB, *, upward: bool = False, bold: bool = False
    ) -> None:
        """``text`` with its top left corner at (x, y); ``upward`` turns it a quarter turn
        anticlockwise (reading bottom to top, its box's top left corner at (x, y))."""
        length = font.text_width(text, _SCALE)
        for i, ch in enumerate(text):
            for r, row in enumerate(font.glyph(ch)):
                for c, ink in enumerate(row):
                    if ink != "#":
                        continue
                    u, v = (i * (font.WIDTH + 1) + c) * _SCALE, r * _SCALE
                    px, py = (x + v, y + length - u - _SCALE) if upward else (x + u, y + v)
                    self.fill(px, py, px + _SCALE + bold, py + _SCALE, colour)

    def png(self) -> bytes:
        stride = self.width * 3
        raw = b"".join(
            b"\x00" + bytes(self.pixels[r * stride : (r + 1) * stride]) for r in range(self.height)
        )

        def chunk(tag: bytes, data: bytes) -> bytes:
            crc = struct.pack(">I", zlib.crc32(tag + data))
            return struct.pack(">I", len(data)) + tag + data + crc

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b"")
        )


@dataclass(slots=True)
class _Frame:
    """The plotting area in pixels and the data range it shows."""

    left: int
    top: int
    right: int
    bottom: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    inset: int = 10
    """Pixels kept free inside the axes so that thick lines at the ends stay whole."""

    def px(self, x: float) -> int:
        (lo, hi), span = self.x_range, self.right - self.left - 2 * self.inset
        return self.left + self.inset + round((x - lo) / (hi - lo) * span)

    def py(self, y: float) -> int:
        (lo, hi), span = self.y_range, self.bottom - self.top
        return self.bottom - round((y - lo) / (hi - lo) * span)


def _thickness(index: int) -> int:
    # Earlier series thicker: a later one drawn over an equal curve stays visible inside it.
    return max(2, 7 - 3 * index)


def _legend_rows(series: Sequence[Series], left: int, right: int) -> list[list[tuple[int, int]]]:
    """(series index, x) of each legend entry, wrapped into rows that fit in [left, right]."""
    rows: list[list[tuple[int, int]]] = [[]]
    x = left
    for i, (name, _pts, _colour) in enumerate(series):
        entry = 40 + font.text_width(name, _SCALE)
        if rows[-1] and x + entry > right:
            rows.append([])
            x = left
        rows[-1].append((i, x))
        x += entry + 28
    return rows


MAX_LABEL_ROWS = 3
"""Rows of mark labels above a chart; a label that fits in none is left out (its line stays)."""


def _place_labels(
    xs: Sequence[int], widths: Sequence[int], left: int, right: int
) -> list[tuple[int, int] | None]:
    """(row, start) of each mark's label, or None where it is left out: the lowest row number
    (0 = top, fewer than :data:`MAX_LABEL_ROWS`) where it fits right of its line, or else left
    of it. A label may not overlap another, be crossed by the line of a mark labelled higher
    up, or sit over its own line's way down past a lower label. Labels placed are bounded by
    the rows' width, so the cost is O(marks) times that bound, whatever the number of marks."""
    placed: list[tuple[int, int, int, int]] = []  # (row, start, end, line x)

    def free(row: int, start: int, end: int, x: int) -> bool:
        return all(
            not (r == row and s < end + 12 and start < e + 12)
            and not (r < row and start - 4 <= mx <= end + 4)
            and not (r > row and s - 4 <= x <= e + 4)
            for r, s, e, mx in placed
        )

    out: list[tuple[int, int] | None] = []
    for x, width in zip(xs, widths, strict=True):
        spot = next(
            (
                (row, start)
                for row in range(MAX_LABEL_ROWS)
                for start in (x + 8, x - 8 - width)
                if width > 0
                and left <= start
                and start + width <= right
                and free(row, start, start + width, x)
            ),
            None,
        )
        if spot is not None:
            placed.append((spot[0], spot[1], spot[1] + width, x))
        out.append(spot)
    return out


def png_chart(
    series: Sequence[Series],
    path: str | Path,
    *,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    marks: Sequence[Mark] = (),
    width: int = 960,
    height: int = 540,
) -> Path:
    """Write the series as a PNG line chart; its path. From the top: the title, a legend naming
    each series beside a stroke of its colour, the marks' labels, then the chart with round
    tick values and light grid lines. Later series are drawn over earlier ones, thinner, so
    that equal curves both stay visible."""
    x0, x1, y0, y1 = _bounds(series)
    pad = (y1 - y0) * 0.05
    x_ticks, y_ticks = ticks(x0, x1), ticks(y0 - pad, y1 + pad)
    glyph_h = font.HEIGHT * _SCALE
    left = _MARGIN + (glyph_h + 14 if y_label else 0)
    left += max((font.text_width(label, _SCALE) for _, label in y_ticks), default=0) + 14
    right = width - _MARGIN - font.text_width(x_ticks[-1][1] if x_ticks else "", _SCALE) // 2
    bottom = height - _MARGIN - (glyph_h + 12 if x_label else 0) - glyph_h - 12
    frame = _Frame(left, 0, right, bottom, (x0, x1), (y0 - pad, y1 + pad))
    canvas = _Canvas(width, height)
    top = _header(canvas, series, title, frame)
    labels = _place_labels(
        [frame.px(m.x) for m in marks],
        [font.text_width(m.label, _SCALE) for m in marks],
        left,
        width - _MARGIN,
    )
    rows = max((spot[0] for spot in labels if spot is not None), default=-1) + 1
    frame.top = top + rows * _LINE + 8
    _axes(canvas, frame, x_ticks, y_ticks)
    for mark, spot in zip(marks, labels, strict=True):
        ink, x = rgb(mark.colour), frame.px(mark.x)
        y = frame.top - 8 if spot is None else top + spot[0] * _LINE
        canvas.line((x, y), (x, frame.bottom), ink, thickness=2, dash=6)
        if spot is not None:
            canvas.text(spot[1], y + 2, mark.label, ink)
    for i, (_name, pts, colour) in enumerate(series):
        for a, b in itertools.pairwise(sorted(pts)):
            a_px, b_px = (frame.px(a[0]), frame.py(a[1])), (frame.px(b[0]), frame.py(b[1]))
            canvas.line(a_px, b_px, rgb(colour), thickness=_thickness(i))
    if x_label:
        x = (frame.left + frame.right - font.text_width(x_label, _SCALE)) // 2
        canvas.text(x, height - _MARGIN - glyph_h, x_label, _TEXT)
    if y_label:
        y = (frame.top + frame.bottom - font.text_width(y_label, _SCALE)) // 2
        canvas.text(_MARGIN, y, y_label, _TEXT, upward=True)
    out = Path(path)
    out.write_bytes(canvas.png())
    return out


def _header(canvas: _Canvas, series: Sequence[Series], title: str, frame: _Frame) -> int:
    """Draw the title and the legend; the y just below them."""
    y = _MARGIN
    if title:
        title_w = font.text_width(title, _SCALE)
        x = (canvas.width - title_w) // 2 if title_w <= canvas.width - 2 * _MARGIN else _MARGIN
        canvas.text(x, y, title, _TEXT, bold=True)
        y += _LINE + 8
    for row in _legend_rows(series, frame.left, canvas.width - _MARGIN):
        for i, x in row:
            name, _pts, colour = series[i]
            mid = y + font.HEIGHT * _SCALE // 2
            canvas.line((x, mid), (x + 28, mid), rgb(colour), thickness=_thickness(i))
            canvas.text(x + 40, y, name, _TEXT)
        y += _LINE
    return y + 4


def _axes(
    canvas: _Canvas,
    frame: _Frame,
    x_ticks: Sequence[tuple[float, str]],
    y_ticks: Sequence[tuple[float, str]],
) -> None:
    """Grid lines, the two axes, their ticks and the tick values."""
    glyph_h = font.HEIGHT * _SCALE
    for value, label in x_ticks:
        x = frame.px(value)
        canvas.line((x, frame.top), (x, frame.bottom), _GRID)
        canvas.line((x, frame.bottom), (x, frame.bottom + 6), _AXIS, thickness=2)
        text_x = x - font.text_width(label, _SCALE) // 2
        canvas.text(text_x, frame.bottom + 12, label, _TEXT)
    for value, label in y_ticks:
        y = frame.py(value)
        canvas.line((frame.left, y), (frame.right, y), _GRID)
        canvas.line((frame.left - 6, y), (frame.left, y), _AXIS, thickness=2)
        text_x = frame.left - 10 - font.text_width(label, _SCALE)
        canvas.text(text_x, y - glyph_h // 2, label, _TEXT)
    canvas.line((frame.left, frame.top), (frame.left, frame.bottom), _AXIS, thickness=2)
    canvas.line((frame.left, frame.bottom), (frame.right, frame.bottom), _AXIS, thickness=2)
