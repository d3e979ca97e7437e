"""Small line charts without a plotting library: a terminal chart and a PNG file.

Used by the demo to show a loss curve over another. The PNG writer draws anti-aliasing-free
lines into an RGB buffer and encodes it with zlib (the PNG format needs nothing more).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Series = tuple[str, Sequence[tuple[float, float]], str]
"""(label, points (x, y), marker character for the terminal / colour name for PNG)."""

_COLOURS = {
    "blue": (40, 90, 200),
    "red": (210, 50, 40),
    "green": (40, 150, 60),
    "grey": (150, 150, 150),
}


def _bounds(series: Sequence[Series]) -> tuple[float, float, float, float]:
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
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


def png_chart(
    series: Sequence[Series],
    path: str | Path,
    *,
    width: int = 800,
    height: int = 400,
    marks: Sequence[float] = (),
) -> Path:
    """Write the series as a PNG line chart (white background, light grid)."""
    x0, x1, y0, y1 = _bounds(series)
    pad = 30
    px = bytearray(b"\xff" * (width * height * 3))

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            px[i : i + 3] = bytes(rgb)

    def to_px(x: float, y: float) -> tuple[int, int]:
        return (
            pad + round((x - x0) / (x1 - x0) * (width - 2 * pad)),
            height - pad - round((y - y0) / (y1 - y0) * (height - 2 * pad)),
        )

    def line(
        a: tuple[int, int], b: tuple[int, int], rgb: tuple[int, int, int], width: int = 2
    ) -> None:
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for k in range(n + 1):
            x = a[0] + (b[0] - a[0]) * k // n
            y = a[1] + (b[1] - a[1]) * k // n
            for dx in range(width):
                for dy in range(width):
                    put(x + dx - width // 2, y + dy - width // 2, rgb)

    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        gy = height - pad - round(frac * (height - 2 * pad))
        line((pad, gy), (width - pad, gy), (230, 230, 230))
    for x in marks:
        mx, _ = to_px(x, y0)
        line((mx, pad), (mx, height - pad), _COLOURS["grey"])
    for i, (_label, pts, colour) in enumerate(series):
        rgb = _COLOURS.get(colour, _COLOURS["blue"])
        ordered = sorted(pts)
        # Earlier series thicker: a later one drawn on top of an equal curve stays visible
        # inside it.
        for a, b in itertools.pairwise(ordered):
            line(to_px(*a), to_px(*b), rgb, width=max(2, 7 - 3 * i))
    raw = b"".join(b"\x00" + bytes(px[r * width * 3 : (r + 1) * width * 3]) for r in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(
        b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    )
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    out = Path(path)
    out.write_bytes(png)
    return out
