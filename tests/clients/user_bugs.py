"""A plain DDP classifier with the classic mistakes that hang a job, each switched on by BUG.

torchrun --nproc-per-node 2 user_bugs.py
A small MLP with a BatchNorm (so DDP broadcasts its buffers at every training forward), trained
on each rank's own shard (no DistributedSampler), EPOCHS epochs of STEPS batches; at each epoch's
end the loss is averaged over the ranks, rank 0 saves a checkpoint, then a barrier.
Environment: STEPS (15 per epoch), EPOCHS (2), BATCH (8), AT (the step a bug fires at, 5),
BN (1; 0 drops the BatchNorm), STEP_SECONDS (0: a sleep per step, as more compute), SAVE_SECONDS (30, with BUG=slow_save), SAME_SHAPES (0, with
BUG=order), BUG, one of:
  val_rank0    rank 0 validates through the DDP model at step AT, without torch.no_grad()
  nan_skip     rank 1's batch at step AT holds an inf; the loop skips non-finite losses
  except_skip  rank 1's batch at step AT has a label out of range; the loop skips batches that raise
  uneven       rank 1's shard holds one batch more than rank 0's
  slow_save    rank 0's checkpoint save takes SAVE_SECONDS
  order        the ranks call the epoch-end collectives in a different order
  early_exit   rank 1 leaves the loop after step AT and ends the job on its side
  reduce_op    rank 1 reduces the epoch metric with MAX where rank 0 sums it (nothing hangs)
  dtype        rank 1's epoch metric is int32 where rank 0's is float32 (same width: nothing hangs)
  breakpoint   a breakpoint() left in rank 1's loop at step AT (no terminal: pdb quits)
  root         each rank broadcasts the epoch metric from itself (src=rank where src=0 was meant)
  group_rank0  rank 0 alone creates a process group of both ranks at the epoch end
  caught       rank 1 finds a bad sample at step AT and raises; main() catches every exception,
               prints its traceback (traceback.print_exc) and returns: every rank ends with code 0
  caught_log   the same, reported with logging's logger.exception, then sys.exit(0)
  caught_barrier  the same error, printed, then the script's cleanup: a barrier, in a `finally`
  prompt       rank 1 asks a question with input() at step AT (no terminal: end-of-input)
  model        rank 1 builds its model with a wider hidden layer (a config read per rank)
"""

import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

BUG = os.environ.get("BUG", "")
STEPS, EPOCHS = int(os.environ.get("STEPS", "15")), int(os.environ.get("EPOCHS", "2"))
BATCH, AT = int(os.environ.get("BATCH", "8")), int(os.environ.get("AT", "5"))
STEP_SECONDS = float(os.environ.get("STEP_SECONDS", "0"))
CLASSES = 4


def make_model(rank):
    hidden = 64 if BUG == "model" and rank == 1 else 32  # a config read per rank
    norm = nn.BatchNorm1d(hidden) if os.environ.get("BN", "1") == "1" else nn.Identity()
    return nn.Sequential(nn.Linear(16, hidden), norm, nn.ReLU(), nn.Linear(hidden, CLASSES))


def load_shard(rank):
    """This rank's batches: its own shard of the data."""
    batches = STEPS + (1 if BUG == "uneven" and rank == 1 else 0)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batches, BATCH, 16, generator=gen)
    y = torch.randint(0, CLASSES, (batches, BATCH), generator=gen)
    if rank == 1 and BUG == "nan_skip":
        x[AT - 1, 0, 0] = float("inf")  # a corrupt sample
    if rank == 1 and BUG == "except_skip":
        y[AT - 1, 0] = CLASSES  # a label out of range
    return list(zip(x, y, strict=True))


def save_checkpoint(model, epoch):
    torch.save(model.module.state_dict(), f"checkpoint-{epoch}.pt")
    if BUG == "slow_save":
        time.sleep(float(os.environ.get("SAVE_SECONDS", "30")))  # SLOW SAVE


def epoch_end_sync(rank, loss_sum, batches):
    """Average the loss over the ranks; with BUG=order also share a learning-rate scale."""
    stats = torch.tensor([loss_sum, float(batches)])
    if BUG == "dtype" and rank == 1:
        stats = stats.to(torch.int32)  # METRIC DTYPE
    if BUG == "reduce_op" and rank == 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # METRIC MAX
        return stats
    if BUG == "group_rank0" and rank == 0:
        dist.new_group([0, 1])  # GROUP ON RANK 0
    if BUG == "root":
        dist.broadcast(stats, src=rank)  # ROOT FROM RANK
        return stats
    if BUG != "order":
        dist.all_reduce(stats)  # EPOCH METRIC
        return stats
    scale = torch.ones(2 if os.environ.get("SAME_SHAPES") == "1" else 3)
    if rank == 0:
        dist.all_reduce(stats)  # ORDER RANK0 ALL_REDUCE
        dist.broadcast(scale, src=0)  # ORDER RANK0 BROADCAST
    else:
        dist.broadcast(scale, src=0)  # ORDER RANK1 BROADCAST
        dist.all_reduce(stats)  # ORDER RANK1 ALL_REDUCE
    return stats


def train_epoch(model, optimizer, rank, shard, xval):
    """One pass over the shard: (loss sum, batches trained, whether this rank left early)."""
    loss_sum, trained = 0.0, 0
    for step, (x, y) in enumerate(shard, start=1):
        out = model(x)  # FORWARD
        try:
            loss = F.cross_entropy(out, y)  # LOSS
        except (RuntimeError, IndexError) as err:
            print(f"rank {rank}: skipping a bad batch at step {step}: {err}", flush=True)  # EXCEPT SKIP
            continue
        if not torch.isfinite(loss):
            print(f"rank {rank}: non-finite loss at step {step}, skipping", flush=True)  # NAN SKIP
            continue
        if BUG.startswith("caught") and rank == 1 and step == AT:
            raise ValueError(f"sample {step} of rank {rank} is corrupt")  # BAD SAMPLE
        if BUG == "prompt" and rank == 1 and step == AT:
            input("Continue with the corrupt sample? [y/N] ")  # PROMPT
        if BUG == "breakpoint" and rank == 1 and step == AT:
            breakpoint()  # BREAKPOINT
        optimizer.zero_grad()  # AFTER BREAKPOINT
        loss.backward()  # BACKWARD
        optimizer.step()
        time.sleep(STEP_SECONDS)  # the rest of a real step's compute
        loss_sum, trained = loss_sum + loss.item(), trained + 1
        if BUG == "val_rank0" and rank == 0 and step == AT:
            val = model(xval).mean()  # VALIDATION
            print(f"validation {val.item():.3f}", flush=True)
        if BUG == "early_exit" and rank == 1 and step == AT:
            return loss_sum, trained, True  # EARLY EXIT
    return loss_sum, trained, False


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(make_model(rank))  # WRAP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    shard, xval = load_shard(rank), torch.randn(BATCH, 16)
    total = 0
    for epoch in range(EPOCHS):
        loss_sum, trained, left = train_epoch(model, optimizer, rank, shard, xval)
        total += trained
        if left:
            print(f"rank {rank} stops early after {total} steps", flush=True)
            break
        stats = epoch_end_sync(rank, loss_sum, trained)
        if rank == 0:
            print(f"epoch {epoch}: loss {stats[0].item() / stats[1].item():.4f}", flush=True)
            save_checkpoint(model, epoch)  # SAVE
        dist.barrier()  # BARRIER
    dist.destroy_process_group()
    print(f"rank {rank} done: {total} steps", flush=True)


if __name__ == "__main__":
    if BUG == "caught_barrier":
        try:
            main()
        except Exception:
            traceback.print_exc()
        finally:
            dist.barrier()  # CLEANUP BARRIER
    elif BUG.startswith("caught"):
        try:
            main()
        except Exception:  # a script that reports any error and ends "cleanly"
            if BUG == "caught_log":
                logging.getLogger("train").exception("training failed")
                sys.exit(0)  # CAUGHT EXIT
            traceback.print_exc()
    else:
        main()
