"""A widget that shows lines of Rich Text, drawn through Textual's line API, and scrolls.

A Static re-parses and re-wraps its whole content on every update; the GPU panel changes
every sample, and with 8 GPUs that cost several milliseconds a frame. Here each line is
rendered once per update (wrapped only with `wrap=True` and only when wider than the widget)
and kept as a finished strip (cut to the width, in the widget's style); only the lines that
changed are redrawn. The widget is as tall as its lines up to its CSS max-height, and scrolls
past that (wheel, or keys when it can take focus).
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
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
        self._strips: list[Strip | None] = []  # one per drawn line; None: to be drawn again
        self._sources: list[int] = []  # for each drawn line, the index of the Text it comes from
        self._width = -1
        self._style: Style | None = None  # rich_style walks the ancestors: once per style change

    @property
    def plain(self) -> str:
        return "\n".join(t.plain for t in self._lines)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style = None
        self._strips = [None] * len(self._strips)

    def set_lines(self, lines: list[Text]) -> None:
        if lines == self._lines:
            return
        old = self._lines
        self._lines = lines
        if self.wrap or len(lines) != len(old):
            self._layout_lines(self._width)
            self.refresh()
            return
        # the same number of lines, one strip each: redraw only those that changed
        changed = [y for y, (new, before) in enumerate(zip(lines, old, strict=True)) if new != before]
        for y in changed:
            self._strips[y] = None
        refresh_runs(self, changed)

    def on_resize(self, event: Resize) -> None:
        width = self.scrollable_content_region.width
        if width != self._width:
            self._layout_lines(width)
            self.refresh()

    def _layout_lines(self, width: int) -> None:
        """Which drawn line shows which Text (wrapping), and the widget's height from that."""
        self._width = width
        sources = []
        for i, text in enumerate(self._lines):
            count = 1
            if self.wrap and width > 0 and text.cell_len > width:
                count = len(text.wrap(self.app.console, width))
            sources += [i] * count
        self._sources = sources
        self._strips = [None] * len(sources)
        old = self.virtual_size.height
        self.virtual_size = Size(max(1, width), len(sources))
        if len(sources) != old:
            self.refresh(layout=True)  # a layout pass redraws the whole screen: only when needed

    def _draw(self, index: int) -> Strip:
        if self._style is None:
            self._style = self.rich_style
        width = max(0, self._width)
        source = self._sources[index]
        text = self._lines[source]
        if self.wrap and width > 0 and text.cell_len > width:
            first = self._sources.index(source)
            text = text.wrap(self.app.console, width)[index - first]
        # one Strip, made from finished segments: each Strip made on the way (crop, pad, style)
        # costs Textual's caches
        segments = Segment.apply_style(text.render(self.app.console), self._style)
        return Strip(Segment.adjust_line_length(list(segments), width, style=self._style), width)

    def render_line(self, y: int) -> Strip:
        index = y + int(self.scroll_y)
        if not 0 <= index < len(self._strips):
            return Strip.blank(self.scrollable_content_region.width, self._style or self.rich_style)
        strip = self._strips[index]
        if strip is None:
            strip = self._strips[index] = self._draw(index)
        return strip


def refresh_runs(widget: ScrollView, lines: list[int]) -> None:
    """Repaint `lines` (sorted, in the widget's virtual coordinates), one region per run of
    consecutive lines: each refresh call has a cost of its own in Textual."""
    start = prev = None
    for y in [*lines, None]:
        if y is not None and prev is not None and y == prev + 1:
            prev = y
            continue
        if start is not None and prev is not None:
            widget.refresh_lines(start, prev - start + 1)
        start = prev = y


class ScrollLines(TextLines, can_focus=True):
    """TextLines that take focus (tab), so a keyboard can scroll them: up/down, PgUp/PgDn, Home/End."""
