"""A DDP-free training loop whose ranks have helpers, as real programs do (2 ranks, CPU, gloo):

- POOL=1: a `with multiprocessing.Pool()` block (fork) prepares the data; `Pool.__exit__`
  terminates its workers with SIGTERM.
- METER=1: a background thread all-reduces a throughput counter on its own group every 0.2 s,
  for as long as the loop runs.
- STALL=S: rank STALL_RANK (default 1) is stuck S seconds reading its batch at step AT (or at each
  step of STALL_STEPS, "5,15"), while its peer waits in that step's all-reduce (the meter thread
  goes on meanwhile).
- EXIT_AT=N: rank 1 leaves with os._exit(0) after step N (rank 0 then loses its peer).
- THREAD_DIES=1: rank 1's meter thread raises at its 4th round; rank 0's meter waits for it.
- UPLOADER_DIES=1: rank 1 hands its step-AT results to an upload thread, which raises; the ranks
  train on to a healthy end without it.
- PREFETCH=dies|stuck: each rank's batches come from a prefetch thread through a queue; rank 1's
  thread raises (dies) or blocks (stuck) at its step-AT batch, and its main thread waits in
  Queue.get while rank 0 waits in the all-reduce.
- PENDING=1: rank 0 posts an irecv from rank 1 before the loop and waits for it after; rank 1
  sends at the end (an early-stop flag left pending on purpose).
- UNUSED=1: a bug every rank shares: a DDP model with a head its forward never uses and
  find_unused_parameters=False, so each rank raises DDP's "Expected to have finished reduction"
  error at its second forward.

Prints "done <rank> <sum>" at the end."""

import multiprocessing
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

STEPS = int(os.environ.get("STEPS", "30"))
AT = int(os.environ.get("AT", "5"))


def square(i):
    return i * i


def prepare_data(rank):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        return sum(pool.map(square, range(100 * (rank + 1))))


class Meter(threading.Thread):
    def __init__(self, group, rank):
        super().__init__(daemon=True)
        self.group, self.rank, self.stop = group, rank, threading.Event()

    def run(self):
        rounds = 0
        while not self.stop.is_set():
            rounds += 1
            if os.environ.get("THREAD_DIES") == "1" and self.rank == 1 and rounds == 4:
                raise RuntimeError("metrics endpoint unreachable")  # marker: thread dies
            dist.all_reduce(torch.ones(1), group=self.group)  # marker: meter all_reduce
            time.sleep(0.2)


def prefetch(batches, rank):
    for step in range(1, STEPS + 1):
        if rank == 1 and step == AT:
            if os.environ["PREFETCH"] == "dies":
                raise OSError(f"shard {step} unreadable")  # marker: prefetch raises
            time.sleep(600)  # marker: prefetch stuck
        batches.put(torch.full((4,), float(rank + step)))


def upload(step):
    time.sleep(0.05)
    raise OSError(f"upload of step {step} failed: bucket 'runs' not found")  # marker: upload raises


STALL_STEPS = [int(n) for n in os.environ.get("STALL_STEPS", str(AT)).split(",")]


def read_batch(rank, step):
    if step in STALL_STEPS and rank == int(os.environ.get("STALL_RANK", "1")):
        time.sleep(float(os.environ.get("STALL", "0")))  # marker: stuck read
    return torch.full((4,), float(rank + step))


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))  # self.spare is never used


def train_with_unused_head():
    model = torch.nn.parallel.DistributedDataParallel(TwoHeads())
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()  # marker: unused forward


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if os.environ.get("UNUSED") == "1":
        train_with_unused_head()
    total = prepare_data(rank) if os.environ.get("POOL") == "1" else 0
    meter = None
    if os.environ.get("METER") == "1":
        meter = Meter(dist.new_group(backend="gloo"), rank)
        meter.start()
    flag = torch.zeros(1)
    pending = dist.irecv(flag, src=1) if os.environ.get("PENDING") == "1" and rank == 0 else None
    batches = queue.Queue(maxsize=2)
    if os.environ.get("PREFETCH"):
        threading.Thread(target=prefetch, args=(batches, rank), name="prefetch", daemon=True).start()
    for step in range(1, STEPS + 1):
        x = batches.get() if os.environ.get("PREFETCH") else read_batch(rank, step)  # marker: queue get
        dist.all_reduce(x)  # marker: step all_reduce
        total += int(x.sum())
        if os.environ.get("UPLOADER_DIES") == "1" and rank == 1 and step == AT:
            threading.Thread(target=upload, args=(step,), name="uploader", daemon=True).start()
        if rank == 1 and step == int(os.environ.get("EXIT_AT", "0")):
            os._exit(0)  # marker: os exit
        time.sleep(0.1)
    if os.environ.get("PENDING") == "1":
        if rank == 1:
            dist.send(torch.ones(1), dst=0)
        else:
            pending.wait()
    if meter is not None:
        meter.stop.set()
        meter.join(timeout=5)
    dist.barrier()
    print("done", rank, total, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
