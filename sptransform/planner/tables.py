"""Print a table with rich when it is installed, as aligned plain text otherwise,
and draw stacked memory bars with matplotlib."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class TextTable:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = field(default=())
    right_aligned_from: int = 1
    """Columns from this index on are numbers."""


def print_table(table: TextTable, *, file=None) -> None:
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a test extra, not a core dependency
        _print_plain(table, file=file)
        return
    rich_table = Table()
    for index, column in enumerate(table.columns):
        rich_table.add_column(column, justify="right" if index >= table.right_aligned_from else "left")
    for row in table.rows:
        rich_table.add_row(*row)
    cell_widths = [max(len(cell) for cell in column) for column in zip(table.columns, *table.rows)]
    needed = sum(cell_widths) + 3 * len(cell_widths) + 1  # rich's padding and borders: never wrap a cell
    console = Console(file=file, width=max(needed, Console(file=file).width))
    console.print(table.title, highlight=False, soft_wrap=True)  # a title inside the table wraps to its width
    console.print(rich_table)
    for note in table.notes:
        console.print(note, highlight=False, soft_wrap=True)


def _print_plain(table: TextTable, *, file) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(table.columns, *table.rows)]
    print(table.title, file=file)
    for row in (table.columns, *table.rows):
        cells = [cell.rjust(w) if i >= table.right_aligned_from else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        print("  ".join(cells), file=file)
    for note in table.notes:
        print(note, file=file)


def plot_stacked_bars(
    bars: list[tuple[str, dict[str, float]]], *, limit: float, limit_label: str, unit: str, title: str, path: str,
) -> None:
    """One stacked bar per entry (bucket -> value, in ``unit``) and a line at the memory limit,
    written to ``path``."""
    figure = stacked_bars_figure(bars, limit=limit, limit_label=limit_label, unit=unit, title=title)
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=150, bbox_inches="tight")  # keep the legend below the axes
    except OSError as error:
        raise ValueError(f"cannot write --plot {path!r} ({error.strerror}); give a path in an existing, "
                         "writable folder") from error
    finally:
        plt.close(figure)


def stacked_bars_figure(bars: list[tuple[str, dict[str, float]]], *, limit: float, limit_label: str, unit: str,
                        title: str):
    """The figure of ``plot_stacked_bars``. Bars run horizontally, one row per layout, with the
    layout's label on its row: labels as long as "tp=8 pp=4 dp=2 zero=1 recompute=selective mb=2"
    stay on one line each and cannot overlap however many layouts are shown (the figure grows
    with them), where slanted labels under vertical bars ran into each other."""
    try:
        import matplotlib
    except ImportError as error:
        raise ValueError("--plot needs matplotlib; install it with `pip install matplotlib`") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = list(dict.fromkeys(name for _, values in bars for name in values))
    rows = list(range(len(bars)))[::-1]  # the first (best) layout on top
    figure, axes = plt.subplots(figsize=(10.0, 2.2 + 0.42 * len(bars)), layout="constrained")
    lefts = [0.0] * len(bars)
    colors = plt.get_cmap("tab10").colors
    for index, bucket in enumerate(buckets):
        widths = [values.get(bucket, 0.0) for _, values in bars]
        axes.barh(rows, widths, left=lefts, height=0.7, color=colors[index % len(colors)],
                  label=bucket.replace("_", " + "))
        lefts = [left + width for left, width in zip(lefts, widths)]
    axes.axvline(limit, color="black", linestyle="--", linewidth=1.2, label=limit_label)
    axes.set_yticks(rows, [label for label, _ in bars], fontsize=9)
    axes.set_xlabel(unit)
    axes.set_xlim(0, max([limit, *lefts]) * 1.05)
    axes.set_title(title, fontsize=11)
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    figure.legend(loc="outside lower center", ncol=min(4, len(buckets) + 1), fontsize=8, frameon=False)
    return figure
