"""sddoctor's record of its own failures inside a rank (`sddoctor.instrument.safety`)."""

from __future__ import annotations

import signal

import pytest

from sddoctor.instrument import safety


class _Handler:
    """A program's signal handler as an object (Lightning installs one for SIGTERM)."""

    def __call__(self, signum, frame):
        raise RuntimeError("Connection closed by peer")


@pytest.fixture
def handler():
    previous = signal.signal(signal.SIGUSR1, _Handler())
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_an_error_a_signal_handler_raised_inside_sddoctor_is_not_sddoctors(handler, monkeypatch) -> None:
    recorded = []
    monkeypatch.setattr(safety, "_emit", lambda fields: recorded.append(fields) or True)
    try:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, as inside sddoctor's code
    except RuntimeError as exc:
        safety.internal_error("test: interrupted by a handler", exc)
    try:
        raise ValueError("sddoctor's own")
    except ValueError as exc:
        safety.internal_error("test: its own", exc)
    assert [f["where"] for f in recorded] == ["test: its own"]
