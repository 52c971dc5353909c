"""Small inline SVG charts, drawn on the server: no script, no canvas, readable without colour.

Each chart carries a text alternative (``<title>`` and ``aria-label``) that says what it shows, so a
screen reader gets the figures and the picture is only a summary of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

WIDTH, HEIGHT = 240, 40


def bars(ok: Sequence[int], failed: Sequence[int], label: str) -> Markup:
    """Stacked bars per slot: succeeded below, failed (dead-lettered, expired...) on top."""
    slots = max(len(ok), len(failed), 1)
    top = max((a + b for a, b in zip(ok, failed, strict=False)), default=0) or 1
    w = WIDTH / slots
    parts = []
    for i, (a, b) in enumerate(zip(ok, failed, strict=False)):
        x = i * w + 0.5
        ha, hb = a / top * (HEIGHT - 2), b / top * (HEIGHT - 2)
        if a:
            y = HEIGHT - ha
            parts.append(f'<rect class="ok" x="{x:.1f}" y="{y:.1f}" width="{w - 1:.1f}" height="{ha:.1f}"/>')
        if b:
            y = HEIGHT - ha - hb
            parts.append(f'<rect class="bad" x="{x:.1f}" y="{y:.1f}" width="{w - 1:.1f}" height="{hb:.1f}"/>')
    return _svg("bars", label, "".join(parts))


def line(values: Sequence[float | None], label: str) -> Markup:
    """A line through the slots that have a value (gaps where nothing settled)."""
    known = [v for v in values if v is not None]
    top = max(known, default=0) or 1
    step = WIDTH / max(len(values) - 1, 1)
    points: list[tuple[float, float]] = []
    parts: list[str] = []
    for i, v in enumerate([*values, None]):
        if v is None:
            if len(points) == 1:
                parts.append(f'<circle cx="{points[0][0]:.1f}" cy="{points[0][1]:.1f}" r="1.5"/>')
            elif points:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
                parts.append(f'<polyline points="{path}"/>')
            points = []
            continue
        points.append((i * step, HEIGHT - 1 - v / top * (HEIGHT - 3)))
    return _svg("line", label, "".join(parts))


def _svg(kind: str, label: str, body: str) -> Markup:
    text = escape(label)
    # numbers and fixed class names only; the one piece of text, the label, is escaped above
    return Markup(  # noqa: S704
        f'<svg class="chart {kind}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{text}"><title>{text}</title>'
        f'<line class="axis" x1="0" y1="{HEIGHT - 0.5}" x2="{WIDTH}" y2="{HEIGHT - 0.5}"/>{body}</svg>'
    )
