"""A small DDP program for the launch forms of tests/test_launch_forms.py, with what users add.

Environment: STEPS (10), BOOM (rank 1 raises at that step, attempt 0 of a torchrun restart only),
SEGV (rank 1 dies of a segmentation fault in native code at that step), KILL (rank 1 is killed by
SIGKILL at that step, attempt 0 only: the OOM killer, a one-time node problem), HELPER=1 (each
rank starts a Python child that outlives it, as a metrics or evaluation helper can),
EXCEPTHOOK=1 (a logging sys.excepthook that does not chain to the one before it; EXCEPTHOOK=exit:
one that then ends the process with os._exit(1), not to hang in the teardown), RECORD=1
(main wrapped in torch.distributed.elastic's @record).
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("train")


def log_uncaught(etype, value, tb):
    log.error("uncaught", exc_info=(etype, value, tb))
    sys.__excepthook__(etype, value, tb)
    if os.environ.get("EXCEPTHOOK") == "exit":
        os._exit(1)  # HOOK_EXIT


def main():
    if os.environ.get("EXCEPTHOOK"):
        sys.excepthook = log_uncaught
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("HELPER"):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    model = DDP(nn.Linear(10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, int(os.environ.get("STEPS", "10")) + 1):
        opt.zero_grad()
        if rank == 1 and attempt == 0 and step == int(os.environ.get("BOOM", "0")):
            raise RuntimeError("boom in user code")  # BOOM
        if rank == 1 and attempt == 0 and step == int(os.environ.get("KILL", "0")):
            os.kill(os.getpid(), signal.SIGKILL)  # KILL
        if rank == 1 and step == int(os.environ.get("SEGV", "0")):
            ctypes.string_at(0)  # SEGV
        out = model(torch.randn(8, 10))  # FORWARD
        out.sum().backward()  # BACKWARD
        opt.step()
    dist.destroy_process_group()


if os.environ.get("RECORD"):
    main = record(main)

if __name__ == "__main__":
    main()
