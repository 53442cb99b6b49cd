"""A plain DDP-style user script (no sddoctor API unless REPORT_STEPS=1): compute, then one all_reduce per step.

Environment: STEPS (default 20), PAUSE seconds of "compute" per step (default 0.05),
SIZE elements per all_reduce (default 8), DATA_STALL_RANK: that rank's DataLoader worker stops delivering at item 4 (a data-loader stall); REPORT_STEPS=1: report each step with `sdi.step` (the only use of sddoctor's API);
SLOW_RANK: that rank spends SLOW_SECONDS (0.25) more per step in a function of its own (a straggler).
"""

import os
import time

import torch
import torch.distributed as dist


def augment_on_the_cpu() -> None:
    time.sleep(float(os.environ.get("SLOW_SECONDS", "0.25")))  # SLOW_WORK


class Items(torch.utils.data.Dataset):
    def __init__(self, stall: bool) -> None:
        self.stall = stall

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.stall and index >= 4:
            time.sleep(3600)  # a stuck read: network file system, a corrupt file, a deadlock
        return torch.ones(int(os.environ.get("SIZE", "8")))


steps = int(os.environ.get("STEPS", "20"))
pause = float(os.environ.get("PAUSE", "0.05"))
stall_rank = os.environ.get("DATA_STALL_RANK")
dist.init_process_group("gloo")
rank = dist.get_rank()
batches = None
if stall_rank is not None:
    loader = torch.utils.data.DataLoader(Items(str(rank) == stall_rank), batch_size=None, num_workers=1)
    batches = iter(loader)
x, started = torch.ones(int(os.environ.get("SIZE", "8"))), time.time()
for step in range(steps):
    time.sleep(pause)
    if batches is not None:
        x = next(batches)  # DATA
    if os.environ.get("SLOW_RANK") == str(rank):
        augment_on_the_cpu()
    y = x * (rank + 1)
    dist.all_reduce(y)  # COLLECTIVE
    if os.environ.get("REPORT_STEPS") == "1":  # as an instrumented training loop does
        from sddoctor.instrument import api as sdi

        sdi.step(step + 1, loss=1.0 / (step + 1) + 0.01 * rank, samples=4, step_time=time.time() - started)
        started = time.time()
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
