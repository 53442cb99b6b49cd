"""Training loops as users write them around one DDP model, picked by FORM (torchrun, 2 ranks, gloo).

FORM: hook-after-eval (a sanity-check forward under no_grad, then the user's own all-reduce comm
hook), builtin-after-eval (the same with DDP's built-in FP16_COMPRESS hook), builtin (that hook
registered right after construction), fp16-hook (the
fp16_compress_hook registered right after construction), unused (find_unused_parameters=True, a
branch used every other step), static (static_graph=True, a branch never used), join (Join with uneven inputs: rank 1
has 3 fewer batches), zero (ZeroRedundancyOptimizer), accum-synced (gradient accumulation over 2
micro-batches without no_sync: every backward all-reduces, one optimizer step).
Environment: STEPS (12), BATCH (8). Each rank prints how often the user's hook ran, whether its
last gradients were float16 values (fp16 compression ran) and the sum of its trained parameters.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

FORM = os.environ.get("FORM", "")


class Net(nn.Module):
    def __init__(self, branches: int):
        super().__init__()
        self.body = nn.Linear(10, 10)
        self.heads = nn.ModuleList(nn.Linear(10, 5) for _ in range(branches))

    def forward(self, x, head=0):
        return self.heads[head](torch.relu(self.body(x)))


def averaging_hook(state, bucket):
    state["calls"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def register_builtin(model):
    # torch 2.x names it with a leading underscore; torch 1.x without
    register = getattr(model, "register_builtin_comm_hook", None) or model._register_builtin_comm_hook
    register(dist.BuiltinCommHookType.FP16_COMPRESS)


def build(rank):
    branches = 2 if FORM in ("unused", "static") else 1
    model = DDP(Net(branches), find_unused_parameters=FORM == "unused", static_graph=FORM == "static")
    state = {"calls": 0}
    if FORM.endswith("after-eval"):
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 10))  # a sanity check before training
        model.train()
        if FORM == "builtin-after-eval":
            register_builtin(model)
        else:
            model.register_comm_hook(state, averaging_hook)
    if FORM == "builtin":
        register_builtin(model)
    if FORM == "fp16-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model, state


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, state = build(rank)
    if FORM == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, batch = int(os.environ.get("STEPS", "12")), int(os.environ.get("BATCH", "8"))
    if FORM == "join" and rank == 1:
        steps -= 3
    joined = contextlib.nullcontext()
    if FORM == "join":
        from torch.distributed.algorithms.join import Join

        joined = Join([model])
    with joined:
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            head = step % 2 if FORM == "unused" else 0
            for _ in range(2 if FORM == "accum-synced" else 1):
                outputs = model(torch.randn(batch, 10), head=head)  # FORWARD
                loss = outputs.pow(2).mean()
                loss.backward()  # BACKWARD
            # fp16 compression leaves every averaged gradient a float16 value
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            fp16 = all(torch.equal(g, g.half().float()) for g in grads)
            optimizer.step()
    print(f"rank {rank} hook calls {state['calls']} fp16 gradients {fp16}", flush=True)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {rank} parameters {checksum!r}", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
