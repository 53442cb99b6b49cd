"""A widget that shows lines of Rich Text, drawn through Textual's line API.

A Static re-parses and re-wraps its whole content on every update; the GPU panel changes
every sample, and with 8 GPUs that cost several milliseconds a frame. Here each line is
rendered once per update (wrapped only when it is wider than the widget) and kept as a strip.
"""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget


class TextLines(Widget):
    DEFAULT_CSS = "TextLines { height: auto; }"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._lines: list[Text] = []
        self._cache: tuple[int, list[Strip]] | None = None

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self._lines)

    def set_lines(self, lines: list[Text]) -> None:
        if lines == self._lines:
            return
        height = len(self._cache[1]) if self._cache else None
        self._lines = lines
        self._cache = None
        # a new layout only when the height changes: a layout pass redraws the whole screen
        self.refresh(layout=height != len(self._strips(self.size.width)))

    def _strips(self, width: int) -> list[Strip]:
        if self._cache is not None and self._cache[0] == width:
            return self._cache[1]
        console = self.app.console
        strips = []
        for text in self._lines:
            pieces = [text] if text.cell_len <= width or width <= 0 else list(text.wrap(console, width))
            for piece in pieces:
                strips.append(Strip(list(piece.render(console)), piece.cell_len))
        self._cache = (width, strips)
        return strips

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._strips(width))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        strips = self._strips(width)
        strip = strips[y] if y < len(strips) else Strip.blank(width)
        return strip.crop(0, width).extend_cell_length(width).apply_style(self.rich_style)
