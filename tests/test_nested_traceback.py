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
