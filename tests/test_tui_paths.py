"""Call sites as the screen shows them: relative to the job's folder, libraries from the package."""

from __future__ import annotations

import os

import pytest

from sddoctor.tui.paths import elide_path, short_path, short_site, shorten_paths_in

JOB = "/home/alice/proj"


@pytest.mark.parametrize(
    ("path", "job_dir", "shown"),
    [
        ("/home/alice/proj/train.py", JOB, "train.py"),
        ("/home/alice/proj/sd/models/unet.py", JOB + "/", "sd/models/unet.py"),
        ("/home/alice/projection/x.py", JOB, "/home/alice/projection/x.py"),  # not inside: a prefix only
        ("train.py", JOB, "train.py"),  # relative already: relative to the job's folder
        (
            "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
            JOB,
            "torch/nn/modules/module.py",
        ),
        ("/usr/lib/python3/dist-packages/torch/distributed/c10d.py", None, "torch/distributed/c10d.py"),
        ("/usr/lib/python3.12/threading.py", JOB, "threading.py"),
        ("/usr/lib/python3.13t/concurrent/futures/thread.py", None, "concurrent/futures/thread.py"),
        ("/srv/jobs/x/train.py", None, "/srv/jobs/x/train.py"),
    ],
)
def test_short_path(path, job_dir, shown):
    assert short_path(path, job_dir) == shown


def test_a_path_under_home_outside_the_job_is_shown_from_home():
    home = os.path.expanduser("~")
    assert short_path(f"{home}/elsewhere/x.py", JOB) == "~/elsewhere/x.py"


def test_short_site_keeps_the_line():
    assert short_site("/home/alice/proj/train.py:212", JOB) == "train.py:212"
    assert short_site("/x/site-packages/torch/nn/parallel/distributed.py:1523", None) == (
        "torch/nn/parallel/distributed.py:1523"
    )
    assert short_site(None, JOB) is None and short_site("?", JOB) == "?"


def test_paths_inside_a_stack_dump_are_shortened():
    dump = (
        'Thread 7 (idle): "MainThread"\n'
        "    save_checkpoint (/home/alice/proj/train.py:188)\n"
        "    forward (/opt/v/lib/python3.11/site-packages/torch/nn/modules/module.py:1750)\n"
    )
    assert shorten_paths_in(dump, JOB) == (
        'Thread 7 (idle): "MainThread"\n'
        "    save_checkpoint (train.py:188)\n"
        "    forward (torch/nn/modules/module.py:1750)\n"
    )


@pytest.mark.parametrize(
    ("width", "shown"),
    [
        (40, "torch/nn/parallel/distributed.py:1523"),
        (36, "torch/…/parallel/distributed.py:1523"),
        (33, "torch/…/distributed.py:1523"),
        (27, "torch/…/distributed.py:1523"),
        (21, "…/distributed.py:1523"),  # not even package/…/file fits
        (15, "…ibuted.py:1523"),  # not even the file: its start goes
    ],
)
def test_elide_path_cuts_folders_out_of_the_middle(width, shown):
    assert elide_path("torch/nn/parallel/distributed.py:1523", width) == shown


def test_elide_path_of_a_bare_file():
    assert elide_path("train.py:212", 12) == "train.py:212"
    assert elide_path("train.py:212", 8) == "….py:212"
