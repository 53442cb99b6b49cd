"""A plain user script for the instrument tests: no sddoctor import unless it reports records.

Run as a rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set). Modes:
  trace   a tour of collectives; after each one prints `REC <json of the tracer's last call>`;
          then rank 1 raises ValueError (the exception hook)
  loop    N all-reduces then a barrier (the fault tests)
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # bound after the bootstrap patched torch.distributed

mode = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def report(label):
    from sddoctor.instrument import tracing

    tracer = tracing.active()
    rec = tracer.last_done.as_dict() if tracer and tracer.last_done else None
    snapshot = tracer.snapshot() if tracer else {}
    line = {
        "label": label,
        "rec": rec,
        "issued": snapshot.get("issued"),
        "main": snapshot.get("last_done_main"),
    }
    print("REC " + json.dumps(line), flush=True)


if mode == "trace":
    t = torch.ones(4, 3)
    all_reduce(t)  # @trace-all-reduce
    report("all_reduce")
    dist.broadcast(torch.zeros(2, dtype=torch.int64), src=0)  # @trace-broadcast
    report("broadcast")
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})  # @trace-object
    report("all_gather_object")
    work = dist.all_reduce(torch.ones(5), async_op=True)  # @trace-async
    work.wait()
    import time

    time.sleep(1.6)  # the heartbeat polls the work
    report("async")
    if rank == 0:
        dist.send(torch.ones(3), dst=1)  # @trace-send
    elif rank == 1:
        dist.recv(torch.zeros(3), src=0)  # @trace-recv
    report("p2p")
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
    for work in dist.batch_isend_irecv(ops):  # @trace-batch
        work.wait()
    time.sleep(1.6)
    report("batch")
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub)  # @trace-subgroup
    report("subgroup")
    dist.barrier()  # @trace-barrier
    report("barrier")
    import threading

    def metrics():
        dist.all_reduce(torch.ones(1), group=sub)  # @trace-thread

    helper = threading.Thread(target=metrics)
    helper.start()
    helper.join()
    report("thread")
    if rank == 1:
        raise ValueError("bad batch on rank 1")  # @crash-raise
elif mode == "loop":
    t = torch.ones(4)
    for _ in range(int(sys.argv[2])):
        dist.all_reduce(t)  # @loop-all-reduce
    dist.barrier()  # @loop-barrier
    print(f"rank {rank} finished", flush=True)
dist.destroy_process_group()
