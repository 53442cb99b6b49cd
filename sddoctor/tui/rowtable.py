"""A light table widget: pre-formatted rows drawn line by line, with a row cursor.

Textual's DataTable re-renders every visible cell through Rich after any change; at one
update a second with 8 GPUs that alone cost more than 1% of a core. The monitor's tables are
rewritten wholesale each sample and need no cell editing, so this widget lays each row out
once as a single Text and draws it as a strip (Textual's line API). It keeps what the
monitor uses from DataTable: a header, a cursor kept on the same row key across updates,
keys (up/down/page/home/end, enter), mouse (click to select, click again to open, wheel), and
a `RowSelected` message.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

GAP = 2


class RowTable(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    RowTable { height: 1fr; }
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

    def __init__(self, columns: list[str], *, id: str | None = None, max_width: int = 80) -> None:  # noqa: A002
        super().__init__(id=id)
        self.columns = columns
        self.max_width = max_width
        self._rows: list[tuple[str, list[Text]]] = []
        self._widths = [len(c) for c in columns]
        self.cursor_row = 0

    # -- data ----------------------------------------------------------------------------------

    @property
    def row_count(self) -> int:
        return len(self._rows)

    def get_row_at(self, index: int) -> list[str]:
        return [c.plain for c in self._rows[index][1]]

    def row_key(self, index: int) -> str:
        return self._rows[index][0]

    def set_rows(self, rows: list[tuple[str, list[Text]]]) -> None:
        """Replace all rows; the cursor stays on the row with the same key when there is one."""
        if rows == self._rows:
            return
        current = self._rows[self.cursor_row][0] if 0 <= self.cursor_row < len(self._rows) else None
        widths = [len(c) for c in self.columns]
        for _, cells in rows:
            for i, cell in enumerate(cells[: len(widths)]):
                widths[i] = max(widths[i], min(cell.cell_len, self.max_width))
        keys = [k for k, _ in rows]
        if widths == self._widths and keys == [k for k, _ in self._rows]:
            # the same rows with some new values: redraw only the lines that changed
            changed = [i for i, (new, old) in enumerate(zip(rows, self._rows, strict=True)) if new != old]
            self._rows = rows
            for i in changed:
                self.refresh_line(i + 1)  # line 0 is the header
            return
        self._rows, self._widths = rows, widths
        self.cursor_row = (
            keys.index(current) if current in keys else min(self.cursor_row, max(0, len(rows) - 1))
        )
        self.virtual_size = Size(sum(widths) + GAP * len(widths), len(rows) + 1)
        self.refresh()

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

    def _line_text(self, cells: list[Text]) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis")
        for width, cell in zip(self._widths, cells, strict=False):
            piece = cell.copy()
            piece.truncate(width, overflow="ellipsis", pad=True)
            line.append_text(piece)
            line.append(" " * GAP)
        return line

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        scroll_x, scroll_y = self.scroll_offset
        if y == 0:
            text = self._line_text([Text(c) for c in self.columns])
            style = self.get_component_rich_style("rowtable--header")
        else:
            index = y - 1 + scroll_y
            if index >= len(self._rows):
                return Strip.blank(width, self.rich_style)
            text = self._line_text(self._rows[index][1])
            if index == self.cursor_row:
                style = self.get_component_rich_style("rowtable--cursor")
            elif index % 2:
                style = self.get_component_rich_style("rowtable--odd")
            else:
                style = Style()
        segments = list(text.render(self.app.console))
        strip = Strip(segments, text.cell_len).crop(scroll_x, scroll_x + width)
        strip = strip.extend_cell_length(width)
        return strip.apply_style(self.rich_style + style) if style else strip.apply_style(self.rich_style)

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
