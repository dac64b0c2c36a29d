"""A result table as a figure: one panel per measured column, one bar per row, labelled by the row's
identifying columns. For the `llmserve bench` commands whose results are small tables (prefix-cache,
priority, spec-decode), so `--plot` draws exactly what the result file holds."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmserve.benchmarks.results import pyplot, save_figure


@dataclass(frozen=True)
class TablePanel:
    title: str
    rows: Sequence[dict]
    label_columns: Sequence[str]  # what names a row (its bar's label)
    value_column: str  # what the bar's length shows


def row_label(row: dict, columns: Sequence[str]) -> str:
    return " ".join(f"{row[c]}" if isinstance(row[c], str) else f"{c}={row[c]}" for c in columns)


def plot_table(panels: Sequence[TablePanel], path: str | os.PathLike) -> Path:
    """Panels stacked top to bottom; a missing value (None) is drawn as an empty bar."""
    plt = pyplot()
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 0.45 * sum(len(p.rows) for p in panels)))
    for axis, panel in zip([axes] if len(panels) == 1 else axes, panels, strict=True):
        labels = [row_label(row, panel.label_columns) for row in panel.rows]
        values = [row.get(panel.value_column) or 0.0 for row in panel.rows]
        axis.barh(range(len(values)), values, tick_label=labels)
        axis.invert_yaxis()  # first row on top, as the printed table
        axis.set_title(panel.title, fontsize=10)
        axis.set_xlabel(panel.value_column)
    return save_figure(figure, path)
