"""A widget that shows lines of Rich Text, drawn through Textual's line API, and scrolls.

A Static re-parses and re-wraps its whole content on every update; the GPU panel changes
every sample, and with 8 GPUs that cost several milliseconds a frame. Here each line is
rendered once per update (wrapped only with `wrap=True` and only when wider than the widget)
and kept as a strip; only the lines that changed are redrawn. The widget is as tall as its
lines up to its CSS max-height, and scrolls past that (wheel, or keys when it can take focus).
"""

from __future__ import annotations

from rich.text import Text
from textual.events import Resize
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip


class TextLines(ScrollView, can_focus=False):
    DEFAULT_CSS = """
    TextLines { height: auto; overflow-x: hidden; scrollbar-size-vertical: 1; }
    """

    def __init__(self, *, id: str | None = None, wrap: bool = False) -> None:  # noqa: A002
        super().__init__(id=id)
        self.wrap = wrap
        self._lines: list[Text] = []
        self._strips: list[Strip] = []
        self._width = -1

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self._lines)

    def set_lines(self, lines: list[Text]) -> None:
        if lines == self._lines:
            return
        old_lines, old_strips = self._lines, self._strips
        self._lines = lines
        self._build(self._width)
        if len(self._strips) != len(old_strips) or self.wrap:
            self._update_size()
            self.refresh()
            return
        # the same number of lines: redraw only those that changed
        top = int(self.scroll_y)
        for y, (new, old) in enumerate(zip(lines, old_lines, strict=False)):
            if new != old:
                self.refresh_line(y - top)

    def on_resize(self, event: Resize) -> None:
        width = self.scrollable_content_region.width
        if width != self._width:
            self._build(width)
            self._update_size()
            self.refresh()

    def _build(self, width: int) -> None:
        self._width = width
        console = self.app.console
        strips = []
        for text in self._lines:
            pieces = (
                [text] if not self.wrap or text.cell_len <= width or width <= 0 else text.wrap(console, width)
            )
            for piece in pieces:
                strips.append(Strip(list(piece.render(console)), piece.cell_len))
        self._strips = strips

    def _update_size(self) -> None:
        # a new layout only when the height changes: a layout pass redraws the whole screen
        height = len(self._strips)
        old = self.virtual_size.height
        self.virtual_size = Size(max(1, self._width), height)
        if height != old:
            self.refresh(layout=True)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        index = y + int(self.scroll_y)
        strip = self._strips[index] if 0 <= index < len(self._strips) else Strip.blank(width)
        return strip.crop(0, width).extend_cell_length(width).apply_style(self.rich_style)


class ScrollLines(TextLines, can_focus=True):
    """TextLines that take focus (tab), so a keyboard can scroll them: up/down, PgUp/PgDn, Home/End."""
