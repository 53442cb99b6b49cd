"""The optimizer-step seam: batch splitting, and gradient accumulation under real 2-rank DDP (gloo)."""

from __future__ import annotations

import torch

from conftest import two_rank_worker_results
from trainer.step import batch_size, split_batch


def test_split_batch_slices_tensors_and_lists_and_shares_the_rest():
    batch = {
        "x": torch.arange(10).reshape(5, 2),
        "caption": list("abcde"),
        "scale": 0.5,
        "t": torch.tensor(3.0),
    }
    pieces = split_batch(batch, 2)
    assert [batch_size(p) for p in pieces] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), batch["x"])
    assert sum((p["caption"] for p in pieces), []) == list("abcde")
    assert all(p["scale"] == 0.5 and p["t"] is batch["t"] for p in pieces)


# Each rank builds the same tiny model three times and takes one step on the same batch cut as
# 4x1, 2x2 and 1x4 (micro-batch x accumulation), capturing the all-reduced gradients; once with
# the plain step (train.oom_guard=false) and once through the OOM guard on a fresh copy of the UNet
# (the guard's DDP wrapper and hooks stay on the module it guards).
WORKER = r"""
import copy, json, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainer.config import build_config
from trainer.models import build_models
from trainer.objective import DiffusionObjective
from trainer.step import run_step
from sddoctor.instrument.oom_guard import OOMGuard

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = build_config("tiny", overrides=["train.caption_dropout=0.3", "train.min_snr_gamma=5", "train.noise_offset=0.05"])
captions = ["a handwritten digit one", "a handwritten digit two", "the digit six, written by hand", "x"]
out = {}
torch.manual_seed(0)
models = build_models("tiny")
models.vae.requires_grad_(False)
models.text_encoder.requires_grad_(False)
initial = copy.deepcopy(models.unet.state_dict())
for micro in (4, 2, 1):
    models.unet.load_state_dict(initial)
    models.unet.zero_grad(set_to_none=True)
    ddp = DDP(models.unet, bucket_cap_mb=0.5)  # several buckets
    generator = torch.Generator().manual_seed(100 + rank)
    objective = DiffusionObjective(cfg, models, torch.device("cpu"), torch.float32, torch.float32, generator)
    torch.manual_seed(1 + rank)
    batch = objective.prepare({"pixel_values": torch.rand(4, 3, 32, 32) * 2 - 1, "caption": captions})
    grads = {}
    def capture():
        grads.update({n: p.grad.detach().clone() for n, p in models.unet.named_parameters()})
    result = run_step(ddp, batch, micro, 4 // micro, objective.forward_backward, capture)
    del ddp
    flat = torch.cat([g.flatten() for g in grads.values()])
    out[micro] = {"loss": float(result.loss), "grad": flat.tolist()[::97], "norm": float(flat.norm()),
                  "accum": result.grad_accum, "samples": result.samples}
    unet = copy.deepcopy(models.unet)
    guard = OOMGuard(unet, wrap=lambda m: DDP(m, bucket_cap_mb=0.5), optimizer=torch.optim.SGD(unet.parameters()),
                     micro_batch=micro, grad_accum=4 // micro)
    grads = {}
    def capture_guarded():
        grads.update({n: p.grad.detach().clone() for n, p in unet.named_parameters()})
    result = guard.run_step(batch, objective.forward_backward, capture_guarded, step=1)
    guard.settle()
    flat = torch.cat([g.flatten() for g in grads.values()])
    out[f"guard{micro}"] = {"loss": float(result.loss), "grad": flat.tolist()[::97], "accum": result.grad_accum}
json.dump(out, open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_accumulation_matches_one_big_micro_batch(tmp_path):
    ranks = two_rank_worker_results(WORKER, tmp_path, timeout=180)
    for per_rank in ranks:
        whole = per_rank["4"]
        assert whole["accum"] == 1 and per_rank["2"]["accum"] == 2 and per_rank["1"]["accum"] == 4
        assert whole["norm"] > 0
        for micro in ("2", "1"):
            split = per_rank[micro]
            assert split["samples"] == 4
            assert abs(split["loss"] - whole["loss"]) < 1e-5 * max(1.0, whole["loss"])
            worst = max(abs(a - b) for a, b in zip(split["grad"], whole["grad"], strict=True))
            assert worst < 1e-4 * max(abs(g) for g in whole["grad"]), (micro, worst)
        for micro in ("4", "2", "1"):
            guarded, plain = per_rank[f"guard{micro}"], per_rank[micro]
            assert guarded["accum"] == plain["accum"]
            assert abs(guarded["loss"] - plain["loss"]) < 1e-6 * max(1.0, plain["loss"])
            worst = max(abs(a - b) for a, b in zip(guarded["grad"], plain["grad"], strict=True))
            assert worst < 1e-6 * max(abs(g) for g in plain["grad"]), (micro, worst)
    # DDP averaged the gradients: both ranks hold the same ones, though their batches differed.
    assert ranks[0]["2"]["grad"] == ranks[1]["2"]["grad"]
    assert ranks[0]["4"]["loss"] != ranks[1]["4"]["loss"]
