"""A light table widget: pre-formatted rows drawn line by line, with a row cursor.

Textual's DataTable re-renders every visible cell through Rich after any change; at one
update a second with 8 GPUs that alone cost more than 1% of a core. The monitor's tables are
rewritten wholesale each sample and need no cell editing, so this widget draws each row
straight to segments, one per cell, and hands Textual a strip (its line API). It keeps what the
monitor uses from DataTable: a header, a cursor kept on the same row key across updates,
keys (up/down/page/home/end, enter), mouse (click to select, click again to open, wheel), and
a `RowSelected` message.

Columns fit the width the table has, as nvitop's and htop's do: each `Column` has a priority,
and the ones that do not fit are left out, least important first (a column whose cells are all
empty is left out too); one `flex` column takes the width the others leave and cuts its cells
its own way (a path keeps its file name). Only when even the columns of priority 0 do not fit
does the table scroll sideways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from sddoctor.tui.textlines import refresh_runs

GAPS = (2, 1)  # space between columns: two where everything that matters fits, else one


@dataclass(frozen=True)
class Column:
    title: str
    priority: int = 0  # 0: always shown; higher numbers are left out first when space is short
    max_width: int = 40  # longer cells are cut with an ellipsis
    align: str = "left"  # "right" for numbers
    flex: bool = False  # takes the width the other columns leave, at least `min_width`
    min_width: int = 8
    clip: Callable[[str, int], str] | None = None  # how a flex cell is cut (default: ellipsis at the end)


def _as_column(c: Column | str) -> Column:
    return c if isinstance(c, Column) else Column(c)


def fit_columns(columns: list[Column], natural: list[int], width: int) -> tuple[list[tuple[int, int]], int]:
    """Which columns to show in `width` cells, and how wide: [(column index, width)], gap.

    `natural[i]` is the width column i's widest cell wants (0: the column is empty, left out).
    """
    present = [i for i, w in enumerate(natural) if w > 0]
    order = sorted(present, key=lambda i: (columns[i].priority, i))
    chosen: list[int] = []
    gap, total = GAPS[0], 0
    for gap in GAPS:
        chosen, total = [], 0
        for i in order:
            c = columns[i]
            need = min(natural[i], max(c.min_width, len(c.title))) if c.flex else natural[i]
            extra = need + (gap if chosen else 0)
            if c.priority == 0 or total + extra <= width:
                chosen.append(i)
                total += extra
        if total <= width:
            break
    widths = {}
    spare = max(0, width - total)
    for i in sorted(chosen):
        c = columns[i]
        if c.flex:
            base = min(natural[i], max(c.min_width, len(c.title)))
            grow = min(natural[i] - base, spare)
            spare -= grow
            widths[i] = base + grow
        else:
            widths[i] = natural[i]
    return [(i, widths[i]) for i in sorted(chosen)], gap


#: A cell: a plain string, or a Text drawn in its (base) style.
Cell = str | Text


def _plain(cell: Cell) -> str:
    return cell if isinstance(cell, str) else cell.plain


def _fit(text: str, width: int, column: Column) -> str:
    """`text` in exactly `width` cells: cut (the column's way, else with an ellipsis), then padded."""
    size = cell_len(text)
    if size > width:
        text = column.clip(text, width) if column.clip is not None else set_cell_size(text, width - 1) + "…"
        size = cell_len(text)
    if size < width:
        pad = " " * (width - size)
        text = pad + text if column.align == "right" else text + pad
    return text


@lru_cache(maxsize=256)
def _style_of(style: str | Style) -> Style:
    return style if isinstance(style, Style) else Style.parse(style)


class RowTable(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    RowTable { height: 1fr; scrollbar-size-vertical: 1; scrollbar-gutter: stable; }
    RowTable > .rowtable--header { text-style: bold; color: $text-accent; }
    RowTable > .rowtable--cursor { background: $accent 40%; }
    RowTable:focus > .rowtable--cursor { background: $accent; color: $text; }
    RowTable > .rowtable--odd { background: $surface-lighten-1 20%; }
    """
    COMPONENT_CLASSES = {"rowtable--header", "rowtable--cursor", "rowtable--odd"}
    BINDINGS = [
        Binding("up", "cursor(-1)", show=False),
        Binding("down", "cursor(1)", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("home", "cursor(-1000000)", show=False),
        Binding("end", "cursor(1000000)", show=False),
        Binding("enter", "select", show=False),
    ]

    @dataclass
    class RowSelected(Message):
        table: RowTable
        cursor_row: int
        key: str

    def __init__(self, columns: Sequence[Column | str], *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.columns = [_as_column(c) for c in columns]
        self._rows: list[tuple[str, list[Cell]]] = []
        self._natural = [len(c.title) for c in self.columns]
        self._layout: tuple[list[tuple[int, int]], int] = ([], GAPS[0])
        self._layout_for: tuple[int, tuple[int, ...]] | None = None
        self.cursor_row = 0
        self._style: Style | None = None  # rich_style walks the ancestors: once per style change

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style = None

    # -- data ----------------------------------------------------------------------------------

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def get_row_at(self, index: int) -> list[str]:
        return [_plain(c) for c in self._rows[index][1]]

    def column_index(self, title: str) -> int:
        return next(i for i, c in enumerate(self.columns) if c.title == title)

    @property
    def shown_columns(self) -> list[str]:
        """Titles of the columns drawn at the present width."""
        return [self.columns[i].title for i, _ in self._layout[0]]

    def set_rows(self, rows: list[tuple[str, list[Cell]]]) -> None:
        """Replace all rows (each a key and its cells: plain strings, or Text for a styled cell);
        the cursor stays on the row with the same key when there is one."""
        if rows == self._rows:
            return
        current = self._rows[self.cursor_row][0] if 0 <= self.cursor_row < len(self._rows) else None
        natural = [0] * len(self.columns)
        for _, cells in rows:
            for i, cell in enumerate(cells[: len(natural)]):
                size = cell_len(cell) if isinstance(cell, str) else cell.cell_len
                if size > natural[i]:
                    natural[i] = size
        for i, c in enumerate(self.columns):
            if natural[i] or not rows:  # an empty column stays out; an empty table shows its header
                natural[i] = max(min(natural[i], c.max_width), len(c.title))
        keys = [k for k, _ in rows]
        if natural == self._natural and keys == [k for k, _ in self._rows]:
            # the same rows with some new values: redraw only the lines that changed
            top = int(self.scroll_y)
            body = range(top, top + max(0, self.scrollable_content_region.height - 1))
            changed = [i for i in body if i < len(rows) and rows[i] != self._rows[i]]
            self._rows = rows
            # only the changed lines: the border and the header stay as drawn (line 0 is the
            # header; refresh_lines takes the scroll off)
            refresh_runs(self, [i + 1 for i in changed])
            return
        self._rows, self._natural = rows, natural
        self.cursor_row = (
            keys.index(current) if current in keys else min(self.cursor_row, max(0, len(rows) - 1))
        )
        self._relayout()

    def on_resize(self, event: Resize) -> None:
        self._relayout()

    def _relayout(self) -> None:
        width = self.scrollable_content_region.width or self.size.width
        key = (width, tuple(self._natural))
        if key != self._layout_for:
            self._layout_for = key
            self._layout = fit_columns(self.columns, self._natural, width)
        shown, gap = self._layout
        line = sum(w for _, w in shown) + gap * max(0, len(shown) - 1)
        height = self.virtual_size.height
        self.virtual_size = Size(line, len(self._rows) + 1)
        # a new layout only when the height changes (it matters to a table of height auto)
        self.refresh(layout=height != self.virtual_size.height)

    def move_cursor(self, row: int) -> None:
        if not self._rows:
            return
        self.cursor_row = max(0, min(row, len(self._rows) - 1))
        body = self.scrollable_content_region.height - 1
        top = int(self.scroll_y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif body > 0 and self.cursor_row >= top + body:
            self.scroll_to(y=self.cursor_row - body + 1, animate=False)
        self.refresh()

    # -- drawing -------------------------------------------------------------------------------

    def _line(self, cells: list[Cell], line_style: Style, plain: bool) -> Strip:
        """One row as a strip as wide as the widget: each cell cut or padded to its column, drawn
        in the cell's own style over `line_style` (a cell's spans are not drawn; `plain` drops
        the cells' styles too)."""
        shown, gap = self._layout
        segments = []
        length = 0
        for n, (i, width) in enumerate(shown):
            if n:
                segments.append(Segment(" " * gap, line_style))
                length += gap
            cell = cells[i] if i < len(cells) else ""
            if isinstance(cell, str):
                text, style = cell, line_style
            else:
                text = cell.plain
                style = line_style if plain or not cell.style else line_style + _style_of(cell.style)
            segments.append(Segment(_fit(text, width, self.columns[i]), style))
            length += width
        width = self.scrollable_content_region.width
        scroll_x = int(self.scroll_x)
        if scroll_x:
            return (
                Strip(segments, length).crop(scroll_x, scroll_x + width).extend_cell_length(width, line_style)
            )
        # one Strip from finished segments: each Strip made on the way costs Textual's caches
        return Strip(Segment.adjust_line_length(segments, width, style=line_style), width)

    def render_line(self, y: int) -> Strip:
        if self._style is None:
            self._style = self.rich_style
        base = self._style
        if y == 0:
            header = base + self.get_component_rich_style("rowtable--header")
            return self._line([c.title for c in self.columns], header, plain=True)
        index = y - 1 + int(self.scroll_y)
        if index >= len(self._rows):
            return Strip.blank(self.scrollable_content_region.width, base)
        cells = self._rows[index][1]
        if index == self.cursor_row:  # plain: a coloured cell would not read on the cursor
            return self._line(cells, base + self.get_component_rich_style("rowtable--cursor"), plain=True)
        if index % 2:
            return self._line(cells, base + self.get_component_rich_style("rowtable--odd"), plain=False)
        return self._line(cells, base, plain=False)

    # -- input ---------------------------------------------------------------------------------

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self.scrollable_content_region.height - 1))

    def action_select(self) -> None:
        if 0 <= self.cursor_row < len(self._rows):
            self.post_message(self.RowSelected(self, self.cursor_row, self._rows[self.cursor_row][0]))

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return  # the header or the border
        index = offset.y - 1 + int(self.scroll_y)
        if index >= len(self._rows):
            return
        if index == self.cursor_row:
            self.action_select()
        else:
            self.move_cursor(index)
