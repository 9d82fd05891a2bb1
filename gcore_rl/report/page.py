"""Assembling one self-contained HTML page from sections of text, tables and Plotly figures.

The page inlines plotly.js once (about 4.5 MB), so it opens without a network; every figure is a
`<div class="plotly-graph-div">` that Plotly fills with SVG when the page loads. All text that
comes from a run (config values, prompts, completions) goes through `html.escape`, so a
completion holding `<script>` shows as text.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.io as pio
from plotly.offline import get_plotlyjs

from gcore_rl.report.timeline import Figure

_PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #222; background: #fafafa; }
header { background: #1f2d3d; color: white; padding: 14px 28px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; font-size: 13px; color: #cfd8e3; }
main { padding: 8px 28px 40px; }
section { background: white; border: 1px solid #e3e3e3; border-radius: 6px; padding: 12px 18px; margin: 14px 0; }
h2 { font-size: 16px; margin: 4px 0 10px; } p.caption { font-size: 12px; color: #666; margin: 2px 0 8px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 8px; }
.notes { background: #fff6e0; border-color: #e8c66a; } .notes li { font-size: 13px; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
th, td { border-bottom: 1px solid #eee; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f5f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; width: 1%; }
td.text { white-space: pre-wrap; font-family: ui-monospace, Menlo, Consolas, monospace; max-width: 600px; word-break: break-word; }
pre { font-size: 12px; background: #f6f8fa; padding: 10px; overflow: auto; max-height: 420px; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; font-size: 13px; margin: 0; }
dl.facts dt { color: #666; } dl.facts dd { margin: 0; }
"""


@dataclass(frozen=True)
class Section:
    """One box of the page: a heading and its HTML body (already escaped)."""

    title: str
    body: str
    css_class: str = ""


def escape(value: Any) -> str:
    return html.escape(str(value), quote=True)


def figure_div(fig: Figure) -> str:
    """The figure as a `<div>` with its script (plotly.js itself is inlined once by `page`)."""
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, config=_PLOTLY_CONFIG, validate=False)


def figure_grid(figures: Sequence[Figure]) -> str:
    return '<div class="grid">' + "".join(f"<div>{figure_div(fig)}</div>" for fig in figures) + "</div>"


def caption(text: str) -> str:
    return f'<p class="caption">{escape(text)}</p>'


def facts(pairs: Sequence[tuple[str, Any]]) -> str:
    """A two-column list of labelled values."""
    return '<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in pairs) + "</dl>"


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: Sequence[int] = ()) -> str:
    """An HTML table; numbers right-aligned, the `text_columns` shown with their line breaks."""
    def cell(index: int, value: Any) -> str:
        if isinstance(value, float):
            return f'<td class="num">{value:.4g}</td>'
        if isinstance(value, int):
            return f'<td class="num">{value}</td>'
        css = ' class="text"' if index in text_columns else ""
        return f"<td{css}>{escape(value)}</td>"

    header = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(cell(i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    """The whole HTML document, plotly.js inlined."""
    boxes = "".join(f'<section class="{escape(s.css_class)}"><h2>{escape(s.title)}</h2>{s.body}</section>'
                    for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style>'
            f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
            f'<body><header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p></header><main>{boxes}</main></body></html>\n')
