"""What every view shares: percentages, the table that never wraps a cell, the key-value
panel, the rendering that picks the widest choice that fits, and the bar chart the plan's and
verify's memory views draw."""
from __future__ import annotations

from typing import Sequence

from rich import box
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ...units import fmt_bytes

_BLOCKS = " ▁▂▃▄▅▆▇█"


def bar_chart(cols: Sequence[int], peak: int, budget_bytes: int | None, height: int, *,
              axis: str, under: str, dense_labels: bool = True,
              dots: Sequence[int | None] | None = None, over_factor: float = 1.0) -> Text:
    """The terminal bar chart of the plan's memory view and of verify's: one bar per value of
    `cols`, `height` rows high, scaled to the larger of `peak` and the budget.

    A bar is red where its value is above `over_factor` x the budget (cyan otherwise), each cell
    a full or partial block; the budget is a yellow line; `dots` (one per column, None: none)
    are drawn as a magenta • in the row of their value, over the bar. The y axis is labelled at
    0, the budget and the top (`dense_labels`: every other row from the top, and the budget's
    label clears its neighbours'); under the chart, `axis` (one character a column) and the
    line `under`.
    """
    scale = max(peak, budget_bytes or 0) or 1
    budget_row = (min(height - 1, int(budget_bytes / scale * height - 1e-9))
                  if budget_bytes else None)
    # a row is labelled with the value at its top edge
    labels = {row: fmt_bytes(scale * (row + 1) / height)
              for row in range(height - 1, 0, -2 if dense_labels else -height)}
    labels[0] = "0"
    if budget_row is not None:
        labels[budget_row] = f"budget {fmt_bytes(budget_bytes)}"
        if dense_labels:                    # keep the budget label clear of its neighbours
            labels.pop(budget_row + 1, None)
            if budget_row > 0:
                labels.pop(budget_row - 1, None)
    lw = max(len(v) for v in labels.values())
    dot_rows = [None if p is None else min(height - 1, int(p / scale * height - 1e-9))
                for p in (dots if dots is not None else [None] * len(cols))]
    text = Text()
    for row in range(height - 1, -1, -1):
        text.append(f"{labels.get(row, ''):>{lw}} ", style="dim")
        text.append("│", style="dim")
        for v, dot_row in zip(cols, dot_rows):
            if dot_row == row:
                text.append("•", style="bold magenta")
                continue
            level = v / scale * height - row       # how much of this cell the bar fills
            over = budget_bytes is not None and v > budget_bytes * over_factor
            if level >= 1:
                text.append("█", "red" if over else "cyan")
            elif level > 0:
                text.append(_BLOCKS[max(1, int(level * 8))], "red" if over else "cyan")
            elif row == budget_row:
                text.append("─", "yellow")
            else:
                text.append(" ", None)
        text.append("\n")
    text.append(" " * lw + " └" + axis + "\n", style="dim")
    text.append(" " * (lw + 2) + under, style="dim")
    return text


# --------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------
def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class Fit:
    """The first of several renderings of the same view that fits the console's width (the last
    one when none does): a wide table where there is room, a narrower one on 80 columns,
    rather than one table squeezed until every cell wraps."""

    def __init__(self, *choices):
        self.choices = choices

    def __rich_console__(self, console, options):
        unbounded = options.update_width(1 << 16)    # measure the natural width, unclamped
        for choice in self.choices[:-1]:
            if Measurement.get(console, unbounded, choice).maximum <= options.max_width:
                yield choice
                return
        yield self.choices[-1]


def short_target(target: str) -> str:
    t = target[5:] if target.startswith("aten.") else target
    return t[:-8] if t.endswith(".default") else t


def kv_table(title: str, rows: Sequence[tuple[str, str | Text]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def rows_table(title: str, cols, rows, compact: bool = False, fixed: tuple = ()) -> Table:
    """A table whose cells never wrap (a number and its unit split over two lines read wrong);
    what does not fit ends in an ellipsis."""
    t = Table(title=title, title_justify="left",
              **({"box": box.SIMPLE_HEAD, "show_edge": False, "padding": 0}
                 if compact else {}))
    for k, (col, just) in enumerate(cols):
        # numbers keep their width; names (left-justified) give way first
        widest = max([len(col)] + [len(str(r[k])) for r in rows])
        keep = just == "right" or col in fixed
        t.add_column(col, justify=just, no_wrap=keep, overflow="ellipsis",
                     min_width=widest if keep else None)
    for r in rows:
        t.add_row(*r)
    return t
