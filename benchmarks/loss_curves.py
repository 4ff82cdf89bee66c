"""Loss curves of two runs side by side, as a hand-written SVG (no plotting library needed).

Used by the benchmarks that train the same model two ways (``convergence.py``, ``char_lm.py``):
the top panel draws each run's loss per step (thin) and a 25-step moving average (thick, the
second run dashed so both show where they overlap), the bottom one |difference| per step on a
log scale.
"""

from __future__ import annotations


def _smooth(values: list, k: int = 25) -> list:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def curves_svg(ref: list, par: list, labels: tuple, width: int = 900) -> str:
    """Two panels: the loss per step of both runs (thin: each step; thick: a 25-step moving
    average, the parallel run's dashed so that both show where they overlap) and |difference|
    per step on a log scale."""
    import math

    left, right, top, panel, gap = 70, 20, 30, 260, 70
    plot_w = width - left - right
    height = top + panel + gap + 160 + 40
    n = max(len(ref), len(par))
    hi = max(max(ref), max(par)) * 1.02

    def x(i):
        return left + plot_w * i / max(1, n - 1)

    def y_loss(v):
        return top + panel * (1 - min(v, hi) / hi)

    def path(values, fy):
        return " ".join(f"{x(i):.1f},{fy(v):.1f}" for i, v in enumerate(values))

    colors = ("#1f77b4", "#d62728")
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="Helvetica" '
        'font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{left}" y="18" font-size="14">training loss per step (thin) and 25-step mean (thick)</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{panel}" fill="none" stroke="#999"/>',
    ]
    for tick in range(0, 5):
        v = hi * tick / 4
        parts.append(f'<text x="{left - 6}" y="{y_loss(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for series, color, dash in zip((ref, par), colors, ("", ' stroke-dasharray="6,4"')):
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-opacity="0.25" points="{path(series, y_loss)}"/>')
        smooth = path(_smooth(series), y_loss)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{smooth}"/>')
    for k, (label, color) in enumerate(zip(labels, colors)):
        lx = left + plot_w - 330
        parts.append(f'<rect x="{lx}" y="{top + 12 + 18 * k}" width="14" height="4" fill="{color}"/>')
        parts.append(f'<text x="{lx + 20}" y="{top + 18 + 18 * k}">{label}</text>')
    # |difference| on a log scale
    diff = [max(abs(a - b), 1e-9) for a, b in zip(ref, par)]
    base = top + panel + gap
    lo_exp, hi_exp = -9, max(-2, math.ceil(math.log10(max(diff))))

    def y_diff(v):
        return base + 160 * (1 - (math.log10(v) - lo_exp) / (hi_exp - lo_exp))

    parts.append(
        f'<text x="{left}" y="{base - 12}" font-size="14">|loss difference| per step (log, 0 drawn at 1e-9)</text>'
    )
    parts.append(f'<rect x="{left}" y="{base}" width="{plot_w}" height="160" fill="none" stroke="#999"/>')
    for e in range(lo_exp, hi_exp + 1, 2):
        parts.append(f'<text x="{left - 6}" y="{y_diff(10.0**e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    parts.append(f'<polyline fill="none" stroke="#444" points="{path(diff, y_diff)}"/>')
    for i in range(0, n, max(1, n // 6)):
        parts.append(f'<text x="{x(i):.1f}" y="{base + 176}" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
