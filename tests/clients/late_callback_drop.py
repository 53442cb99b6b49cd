"""A DDP comm hook whose future callback gloo's worker thread drops only after the main thread has
reached the end of the program: something rank 0's last callback holds takes DROP_SECONDS to
release (torchrun, 2 ranks, gloo). Rank 1 comes LATE_SECONDS late to the last all-reduce, so that
rank 0's callback runs on gloo's thread, not inline. The drop takes the GIL; after the interpreter
ended, that aborts the process. The drop takes longer than the interpreter's end (also on a busy
machine) and shorter than the 2 s that sddoctor's exit waits for callbacks that ran.

MODE=session: sddoctor's rank session is on, whose atexit close waits for the drop of every
BackendCallback. MODE=bare: the same hook and callback, no session: nothing waits.
RUN_DIR: the session's run directory.
"""

import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sddoctor.instrument import api
from sddoctor.instrument.backend_callbacks import BackendCallback

STEPS = 3
DROP_SECONDS = 1.5
LATE_SECONDS = 1.0


class Payload:
    """Something the last step's callback holds: its release is slow."""


def slow_to_drop_hook(state, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    payload = Payload()
    if state["step"] == STEPS and dist.get_rank() == 0:
        weakref.finalize(payload, time.sleep, DROP_SECONDS)

    def done(fut, held=payload):
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(BackendCallback(done))


def main() -> None:
    if os.environ["MODE"] == "session":
        api.enable(os.environ["RUN_DIR"], trace=False, infer_steps=False)
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 8))
    state = {"step": 0}
    model.register_comm_hook(state, slow_to_drop_hook)
    for step in range(1, STEPS + 1):
        state["step"] = step
        if step == STEPS and dist.get_rank() == 1:
            time.sleep(LATE_SECONDS)  # rank 0's callback is attached before its all-reduce completes
        model(torch.randn(4, 8)).sum().backward()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
