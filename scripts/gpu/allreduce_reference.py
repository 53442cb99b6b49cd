"""A minimal, independent all-reduce benchmark to compare `sddoctor check-nccl` against.

It shares no code with sddoctor: plain torch.distributed, wall clock around a synchronized loop,
slowest rank's time, and nccl-tests' formulas (algbw = bytes/time, busbw = algbw * 2(n-1)/n).
Run: torchrun --nproc-per-node N scripts/gpu/allreduce_reference.py [sizes in MiB...]
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    sizes_mib = [int(a) for a in sys.argv[1:]] or [1, 16, 128, 512]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(
            f"# reference all_reduce, {n} ranks, float32, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}"
        )
        print(f"# {'size':>10}  {'iters':>5}  {'time(us)':>10}  {'algbw(GB/s)':>11}  {'busbw(GB/s)':>11}")
    for mib in sizes_mib:
        nbytes = mib * 1024 * 1024
        x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        iters = 20
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t = torch.tensor([(time.perf_counter() - t0) / iters], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = t.item()
        algbw = nbytes / seconds / 1e9
        if rank == 0:
            print(
                f"  {nbytes:>10}  {iters:>5}  {seconds * 1e6:>10.1f}  {algbw:>11.2f}  {algbw * 2 * (n - 1) / n:>11.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
