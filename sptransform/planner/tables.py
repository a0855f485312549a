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
    """One stacked bar per entry (bucket -> value, in ``unit``) and a horizontal memory line."""
    try:
        import matplotlib
    except ImportError as error:
        raise ValueError("--plot needs matplotlib; install it with `pip install matplotlib`") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = list(dict.fromkeys(name for _, values in bars for name in values))
    figure, axes = plt.subplots(figsize=(max(7.0, 1.1 * len(bars) + 3), 5))
    bottoms = [0.0] * len(bars)
    positions = range(len(bars))
    for bucket in buckets:
        heights = [values.get(bucket, 0.0) for _, values in bars]
        axes.bar(positions, heights, bottom=bottoms, label=bucket.replace("_", " + "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.axhline(limit, color="red", linestyle="--", label=limit_label)
    axes.set_xticks(list(positions), [label for label, _ in bars], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel(unit)
    axes.set_title(title)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")  # keep the outside legend
    except OSError as error:
        raise ValueError(f"cannot write --plot {path!r} ({error.strerror}); give a path in an existing, "
                         "writable folder") from error
    finally:
        plt.close(figure)
