"""The DDP comm hook as the bootstrap installs it, next to a user's hook and the OOM guard.

Two real gloo ranks with `ddp_patch` active (as under `sddoctor run`): the bootstrap's hook arrives
at the first forward and counts buckets (`ddp_hook.stats()`), a user's own comm hook registered
after construction is accepted (sddoctor's then stays off), and the OOM guard both wraps a model
built under the patch and takes over a hook that was installed before it (its fault injection and
recovery run through the taken-over hook). A rank that failed mid-step completes the buckets of a
model under DDP's built-in FP16 hook in float16, as its peers send them.
"""

from __future__ import annotations

from pathlib import Path

from conftest import two_rank_worker_results

WORKER = r"""
import gc, json, sys
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from sddoctor.instrument import ddp_hook, ddp_patch
from sddoctor.instrument.faults import parse_faults
from sddoctor.instrument.oom_guard import OOMGuard

dist.init_process_group("gloo")
rank = dist.get_rank()
ddp_patch.install()
from torch.nn.parallel import DistributedDataParallel as DDP
out = {}

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

def step(model, n=4):
    model(torch.randn(n, 8)).sum().backward()

# 1) the bootstrap's hook: installed at the first forward, idempotent, counted
plain = DDP(net())
out["before_forward"] = ddp_hook.installed_state(plain) is not None
step(plain)
state = ddp_hook.installed_state(plain)
out["installed"] = state is not None and ddp_hook.install(plain) is state
out["stats"] = ddp_hook.stats()

# 2) a user's own hook after construction is accepted; sddoctor's stays off that model
user = DDP(net())
user.register_comm_hook(None, default_hooks.allreduce_hook)
step(user)
out["user_hook_kept"] = ddp_hook.installed_state(user) is None

# 3) the guard wraps a model built while the patch is active
module = net()
guard = OOMGuard(module, wrap=lambda m: DDP(m), optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                 micro_batch=4, faults=[])
for s in range(2):
    guard.run_step({"x": torch.randn(4, 8)}, lambda m, mb, k: (m(mb["x"]).sum() * k).backward() or torch.zeros(()),
                   guard.optimizer.step, step=s)
guard.settle()
out["guard_hooked"] = ddp_hook.installed_state(guard.model) is guard.hook_state

# 4) the guard takes over a hook installed before it wrapped (one comm hook per DDP model);
#    the injected backward OOM fires from the taken-over hook and every rank falls back
def installed_early(m):
    ddp = DDP(m)
    ddp_hook.install(ddp)
    return ddp

module = net()
guard = OOMGuard(module, wrap=installed_early, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                 micro_batch=4, faults=parse_faults("oom:rank=1,step=1,phase=backward,bucket=0"))
for s in range(3):
    guard.run_step({"x": torch.randn(4, 8)}, lambda m, mb, k: (m(mb["x"]).sum() * k).backward() or torch.zeros(()),
                   guard.optimizer.step, step=s)
guard.settle()
out["taken_over"] = ddp_hook.installed_state(guard.model) is guard.hook_state
out["micro_batch"] = guard.micro_batch
out["guard_buckets"] = guard.stats()["buckets"]
out["params"] = [float(p.sum()) for p in module.parameters()]
json.dump(out, open(sys.argv[1] + f"/rank{rank}.json", "w"))
# Free the DDP models and guards (and the gloo work objects they reach) while Python is fully alive:
# as module globals they would go at interpreter teardown, where gloo's threads releasing them was
# seen to abort a rank once ("terminate called without an active exception"), as the trainer was.
del plain, user, guard, module, state
gc.collect()
dist.destroy_process_group()
"""


def test_bootstrap_hook_user_hook_and_guard_take_over(tmp_path: Path) -> None:
    ranks = two_rank_worker_results(WORKER, tmp_path)
    for out in ranks:
        assert out["before_forward"] is False and out["installed"] is True
        assert out["stats"]["buckets"] >= 1 and out["stats"]["models"] >= 1
        assert out["user_hook_kept"] is True
        assert out["guard_hooked"] is True and out["taken_over"] is True
        assert out["micro_batch"] == 2  # the fault fired through the taken-over hook; both ranks fell back
        assert out["guard_buckets"] >= 3
    assert ranks[0]["params"] == ranks[1]["params"]


FP16_WORKER = r"""
import json, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from sddoctor.instrument import ddp_hook

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), bucket_cap_mb=0.0005)
state = ddp_hook.install(model)
# the user registers DDP's built-in FP16 hook on a model that already carries sddoctor's
adopted = ddp_hook.adopt_user_hook(model, "_register_builtin_comm_hook", (dist.BuiltinCommHookType.FP16_COMPRESS,), {})
for _ in range(2):  # the layout is final after two full backwards
    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
model.zero_grad()
state.begin_step()
if rank == 0:
    # rank 0's step failed before its backward: it completes every bucket with zeros
    posted = ddp_hook.complete_missing_buckets(model, state)
    grads = None
else:
    posted = 0
    torch.manual_seed(1)
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.flatten().tolist() for p in model.parameters()]
json.dump({"adopted": adopted, "posted": posted, "buckets": len(state.layout), "grads": grads},
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_missing_buckets_of_an_fp16_compressed_model_go_as_float16(tmp_path: Path) -> None:
    """A rank that failed mid-step completes the buckets it never sent with zeros of the dtype its
    peers send: float16 under DDP's built-in FP16 hook (as float32, gloo would abort on the sizes).
    The surviving rank's gradients are then its own, halved, through float16."""
    ranks = two_rank_worker_results(FP16_WORKER, tmp_path)
    assert ranks[0]["adopted"] is True and ranks[0]["buckets"] >= 2
    assert ranks[0]["posted"] == ranks[0]["buckets"]
    import torch

    torch.manual_seed(0)  # no optimizer ran: the parameters are the initial ones
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    torch.manual_seed(1)
    net(torch.randn(4, 8)).sum().backward()
    expected = [p.grad.half().div(2).float().flatten().tolist() for p in net.parameters()]
    assert ranks[1]["grads"] == expected
