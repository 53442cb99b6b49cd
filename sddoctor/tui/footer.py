"""Textual's Footer, built once at start and rebuilt only when the keys it shows change.

Textual's Footer starts empty and removes and re-creates all its keys each time the screen
publishes its bindings. At start the screen publishes them twice with the same result (when
it resumes with focus on the process table, and again after the next refresh, from
`Screen.set_focus`), so the footer was built twice after the screen was up, each time
mounting its keys and laying the screen out again before the first frame with data: the
benchmark's start-up is about 40 ms shorter without that. This footer builds its keys in
its first compose, with the rest of the screen, and skips a publication whose shown keys
are the ones it already shows (or is about to show). What it draws, and how, is Textual's
own `Footer.compose`.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer


class SteadyFooter(Footer):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._built_for: tuple[Any, ...] | None = None
        if hasattr(Footer, "_bindings_ready"):
            # Textual's Footer composes nothing until the first publication, then rebuilds.
            # Composing at mount instead is safe: whatever differs by the time bindings are
            # published (focus not landed yet, say) makes `bindings_changed` rebuild.
            self.set_reactive(Footer._bindings_ready, True)

    def compose(self) -> ComposeResult:
        self._built_for = self._what_it_shows(self.screen)
        yield from super().compose()

    def bindings_changed(self, screen: Screen) -> None:
        shown = self._what_it_shows(screen)
        if shown == self._built_for:
            return
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            # Textual rebuilds under these conditions, after the next refresh, from the
            # bindings of that moment (a change in between publishes again and lands here).
            self._built_for = shown
        super().bindings_changed(screen)

    def _what_it_shows(self, screen: Screen) -> tuple[Any, ...]:
        """What the footer's compose draws from: the screen's active bindings that are shown
        (not the node that holds each: a footer key only simulates its key press), the
        command palette's binding, and the footer's own switches. A keymap change arrives
        as different bindings."""
        palette = self.app.COMMAND_PALETTE_BINDING
        return (
            tuple(
                (key, b.binding, b.enabled, b.tooltip)
                for key, b in screen.active_bindings.items()
                if b.binding.show or key == palette
            ),
            self.show_command_palette,
            self.app.ENABLE_COMMAND_PALETTE,
        )
