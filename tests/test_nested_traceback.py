"""Reading a traceback written inside an exception's message (DataLoader workers)."""

from sddoctor.supervise.nested_traceback import nested_traceback

WORKER = (
    "Caught KeyError in DataLoader worker process 3.\n"
    "Original Traceback (most recent call last):\n"
    '  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 374, in _worker_loop\n'
    "    data = fetcher.fetch(index)\n"
    "           ^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/home/me/train.py", line 41, in __getitem__\n'
    '    return self.rows[i]["caption"]\n'
    "           ~~~~~~~~~~~~^^^^^^^^^^^\n"
    "KeyError: 'caption'\n"
)


def test_a_workers_traceback_gives_its_frames_exception_and_source():
    nested = nested_traceback(WORKER)
    assert nested is not None
    assert nested.source == "DataLoader worker process 3"
    assert nested.frames[-1] == "/home/me/train.py:41 in __getitem__"
    assert nested.frames[0].endswith("worker.py:374 in _worker_loop")
    assert nested.exception == "KeyError: 'caption'"


def test_messages_without_a_traceback_give_none():
    assert nested_traceback("Connection closed by peer") is None
    assert nested_traceback("Traceback (most recent call last):\nno frames here") is None
    assert nested_traceback("") is None


def test_a_traceback_without_a_known_source_still_parses():
    text = 'boom\nTraceback (most recent call last):\n  File "/a.py", line 3, in f\n    g()\nRuntimeError: x'
    nested = nested_traceback(text)
    assert nested is not None and nested.source == "" and nested.exception == "RuntimeError: x"
    assert nested.frames == ("/a.py:3 in f",)


def _bad_record(i: int) -> int:
    if i == 3:
        raise ValueError(f"bad record {i}")  # the worker's line
    return i


def test_a_pool_workers_error_carries_the_workers_traceback():
    """multiprocessing.Pool re-raises a worker's error in the rank with the worker's traceback as
    its cause; the rank's hooks write it into the message, where the worker's line is read."""
    import multiprocessing
    from pathlib import Path

    from sddoctor.instrument.exit_hooks import exception_fields
    from sddoctor.supervise.diagnose_base import exception_location

    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            pool.map(_bad_record, range(5))
    except ValueError as exc:
        fields = exception_fields(exc, exc.__traceback__)
    nested = nested_traceback(fields["message"])
    assert nested is not None and nested.source == "multiprocessing worker", fields["message"]
    assert nested.exception == "ValueError: bad record 3"
    here = Path(__file__).resolve()
    worker_line = next(
        n for n, line in enumerate(here.read_text().splitlines(), 1) if "# the worker's line" in line
    )
    assert nested.frames[-1] == f"{here}:{worker_line} in _bad_record"
    assert exception_location(fields) == f"{here}:{worker_line}"
