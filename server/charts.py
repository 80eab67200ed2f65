"""Charts as inline SVG drawn on the server: no JavaScript, no network, readable in any browser.

Every text that reaches the SVG is escaped here; the result is `Markup` for the templates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from markupsafe import Markup, escape

STATUS_COLOURS = {
    "ok": "#2b7bb9",
    "constraint": "#9e9e9e",
    "compile_error": "#d97b00",
    "runtime_error": "#c62828",
    "timeout": "#7b1fa2",
    "incorrect": "#e91e63",
    "nondeterministic": "#00897b",
}
OTHER_COLOUR = "#555555"

W, H = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 44


def colour(status: str) -> str:
    return STATUS_COLOURS.get(status, OTHER_COLOUR)


def _plottable(y: Any) -> bool:
    """A latency that can go on a log axis: a finite positive number (None, NaN, inf and 0 cannot)."""
    return isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(y) and y > 0


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.3g}"
    return f"{v:.2g}"


class _LogScale:
    def __init__(self, lo: float, hi: float, a: float, b: float) -> None:
        lo, hi = max(lo, 1e-9), max(hi, 1e-9)
        if hi <= lo * 1.0001:
            lo, hi = lo / 1.5, hi * 1.5
        self.lo, self.hi, self.a, self.b = math.log10(lo), math.log10(hi), a, b

    def __call__(self, v: float) -> float:
        t = (math.log10(max(v, 1e-9)) - self.lo) / (self.hi - self.lo)
        return self.a + t * (self.b - self.a)

    def ticks(self) -> list[float]:
        out = []
        for e in range(math.floor(self.lo), math.ceil(self.hi) + 1):
            for m in (1, 2, 5):
                v = m * 10.0 ** e
                if self.lo - 1e-9 <= math.log10(v) <= self.hi + 1e-9:
                    out.append(v)
        if len(out) < 2:
            out = [10 ** self.lo, 10 ** ((self.lo + self.hi) / 2), 10 ** self.hi]
        return out


class _LinScale:
    def __init__(self, lo: float, hi: float, a: float, b: float) -> None:
        if hi <= lo:
            lo, hi = lo - 1, hi + 1
        self.lo, self.hi, self.a, self.b = lo, hi, a, b

    def __call__(self, v: float) -> float:
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self, n: int = 6) -> list[float]:
        raw = (self.hi - self.lo) / n
        mag = 10 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
        start = math.ceil(self.lo / step) * step
        return [start + i * step for i in range(int((self.hi - start) / step) + 1)]


def _frame(title: str, x_label: str, y_label: str, body: list[str], legend: Sequence[str] = ()) -> Markup:
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
             f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" '
             'fill="#fff" stroke="#ccc"/>']
    parts += body
    parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 6}" text-anchor="middle" class="axis-label">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text transform="translate(14 {(TOP + H - BOTTOM) / 2}) rotate(-90)" text-anchor="middle" '
                 f'class="axis-label">{escape(y_label)}</text>')
    x = LEFT + 6
    for status in legend:
        parts.append(f'<circle cx="{x}" cy="{TOP + 8}" r="4" fill="{colour(status)}"/>'
                     f'<text x="{x + 7}" y="{TOP + 12}" class="legend">{escape(status)}</text>')
        x += 14 + 7 * len(status)
    parts.append("</svg>")
    return Markup("".join(parts))


def _y_axis(scale, body: list[str]) -> None:
    for v in scale.ticks():
        y = scale(v)
        body.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                    f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_fmt(v)}</text>')


def _sort_key(v: Any) -> tuple:
    if isinstance(v, bool):
        return (1, str(v))
    if isinstance(v, (int, float)):
        return (0, v)
    return (2, str(v))


def scatter_by_parameter(points: Sequence[tuple[Any, float | None, str]], x_label: str, y_label: str,
                         title: str) -> Markup:
    """Latency (log y) against one schedule parameter (categorical x, jittered); untimed trials on a
    strip above the plot. `points`: (parameter value, latency or None, status)."""
    body: list[str] = []
    timed = [y for _, y, _ in points if _plottable(y)]
    values = sorted({v for v, _, _ in points}, key=_sort_key)
    n_cat = max(len(values), 1)
    strip = TOP + 26
    y_scale = _LogScale(min(timed, default=1.0), max(timed, default=1.0), H - BOTTOM - 6, strip + 26)
    _y_axis(y_scale, body)
    body.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{strip + 7}" y2="{strip + 7}" stroke="#ddd" '
                'stroke-dasharray="3 3"/>'
                f'<text x="{LEFT - 4}" y="{strip + 4}" text-anchor="end" class="tick">no time</text>')
    band = (W - LEFT - RIGHT) / n_cat
    index = {v: i for i, v in enumerate(values)}
    for i, v in enumerate(values):
        cx = LEFT + band * (i + 0.5)
        body.append(f'<text x="{cx:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle" class="tick">'
                    f'{escape(str(v))}</text>')
    statuses = []
    for k, (v, y, status) in enumerate(points):
        jitter = ((k * 0.6180339887) % 1.0 - 0.5) * band * 0.7
        cx = LEFT + band * (index[v] + 0.5) + jitter
        cy = y_scale(y) if _plottable(y) else strip + (k * 0.37 % 1.0) * 10
        body.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{colour(status)}" fill-opacity="0.6"/>')
        if status not in statuses:
            statuses.append(status)
    order = list(STATUS_COLOURS)
    legend = sorted(statuses, key=lambda s: (order.index(s) if s in order else len(order), s))
    return _frame(title, x_label, y_label, body, legend=legend)


def history(values: Sequence[tuple[float, float | None, str]], x_label: str, y_label: str, title: str,
            best_so_far: bool = True) -> Markup:
    """Each trial's latency (log y) against a numeric x (trial index or seconds), and the running best of
    the ok trials as a step line. `values`: (x, latency or None, status)."""
    body: list[str] = []
    timed = [y for _, y, _ in values if _plottable(y)]
    xs = [x for x, _, _ in values] or [0.0, 1.0]
    x_scale = _LinScale(min(xs), max(xs), LEFT + 6, W - RIGHT - 6)
    y_scale = _LogScale(min(timed, default=1.0), max(timed, default=1.0), H - BOTTOM - 6, TOP + 22)
    _y_axis(y_scale, body)
    for v in x_scale.ticks():
        x = x_scale(v)
        body.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle" class="tick">{_fmt(v)}</text>')
    statuses = []
    best, path = math.inf, []
    for x, y, status in values:
        if not _plottable(y):
            continue
        body.append(f'<circle cx="{x_scale(x):.1f}" cy="{y_scale(y):.1f}" r="2" fill="{colour(status)}" '
                    'fill-opacity="0.45"/>')
        if status not in statuses:
            statuses.append(status)
        if status == "ok" and y < best:
            best = y
            px, py = x_scale(x), y_scale(y)
            path.append(f"M{px:.1f},{py:.1f}" if not path else f"H{px:.1f} V{py:.1f}")
    if best_so_far and path:
        path.append(f"H{x_scale(xs[-1]):.1f}")
        body.append(f'<path class="best-so-far" d="{" ".join(path)}" fill="none" stroke="#111" stroke-width="1.5"/>')
    return _frame(title, x_label, y_label, body, legend=statuses)


def bars(items: Sequence[tuple[str, float]], title: str, value_format: str = "{:.0f}",
         colours: dict[str, str] | None = None) -> Markup:
    """Horizontal bars, one per (label, value), largest scale first as given."""
    row = 20
    height = TOP + row * max(len(items), 1) + 8
    top = max((v for _, v in items), default=1.0) or 1.0
    label_w = 170
    parts = [f'<svg class="chart bars" role="img" viewBox="0 0 {W} {height}" width="{W}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for i, (label, value) in enumerate(items):
        y = TOP + i * row
        width = max(0.0, value / top) * (W - label_w - 80)
        fill = (colours or {}).get(label, "#2b7bb9")
        parts.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end" class="tick">{escape(label)}</text>'
                     f'<rect x="{label_w}" y="{y + 3}" width="{width:.1f}" height="{row - 6}" fill="{fill}"/>'
                     f'<text x="{label_w + width + 4:.1f}" y="{y + 13}" class="tick">'
                     f'{escape(value_format.format(value))}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
