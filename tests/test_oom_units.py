"""OOM guard pieces in one process: fallback arithmetic, state_dict/resume, the comm hook on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sddoctor.instrument.ddp_hook import install_comm_hook
from sddoctor.instrument.faults import parse_faults
from sddoctor.instrument.oom_guard import (
    InjectedOutOfMemory,
    OOMGuard,
    OOMGuardError,
    fallback_micro_batch,
    is_oom,
)


@pytest.mark.parametrize(
    ("per_rank", "micro", "expected"),
    [(32, 32, 16), (12, 12, 6), (12, 6, 3), (12, 3, 1), (12, 1, None), (6, 6, 3), (7, 7, 1), (24, 9, 4)],
)
def test_fallback_is_the_largest_divisor_at_most_half(
    per_rank: int, micro: int, expected: int | None
) -> None:
    assert fallback_micro_batch(per_rank, micro) == expected


def test_oom_recognition() -> None:
    assert is_oom(InjectedOutOfMemory("x"))
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED out of memory"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def _single_process_guard(faults: str = "", micro_batch: int = 4, grad_accum: int = 1, **kw) -> OOMGuard:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return OOMGuard(
        model,
        wrap=lambda m: m,
        optimizer=opt,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        faults=parse_faults(faults),
        **kw,
    )


def _fb(model, mb, scale):
    loss = torch.nn.functional.mse_loss(model(mb["x"]).squeeze(-1), mb["y"])
    (loss * scale).backward()
    return loss.detach()


def _batch(step: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, generator=g), "names": list("abcd")[:n]}


def test_guard_state_survives_state_dict_and_resume() -> None:
    guard = _single_process_guard("oom:rank=0,step=1,phase=forward")
    for step in range(3):
        result = guard.run_step(_batch(step), _fb, lambda g=guard: _opt_step(g), step=step)
    guard.settle()
    assert (result.micro_batch, result.grad_accum) == (2, 2)
    state = guard.state_dict()
    assert state == {"micro_batch": 2, "grad_accum": 2, "per_rank_batch": 4, "gradient_checkpointing": False}

    resumed = _single_process_guard()
    resumed.load_state_dict(state)
    assert (resumed.micro_batch, resumed.grad_accum) == (2, 2)
    r = resumed.run_step(_batch(5), _fb, lambda: _opt_step(resumed), step=5)
    assert (r.micro_batch, r.grad_accum, r.fell_back) == (2, 2, False)


def test_resume_turns_gradient_checkpointing_back_on_or_says_how() -> None:
    calls = []
    state = {"micro_batch": 1, "grad_accum": 4, "per_rank_batch": 4, "gradient_checkpointing": True}
    guard = _single_process_guard(enable_gradient_checkpointing=lambda: calls.append(1))
    guard.load_state_dict(state)
    assert calls == [1] and guard.gradient_checkpointing and guard.micro_batch == 1
    with pytest.raises(OOMGuardError, match="enable_gradient_checkpointing"):
        _single_process_guard().load_state_dict(state)


def test_single_process_loss_is_the_mean_over_micro_batches() -> None:
    a = _single_process_guard(micro_batch=4)
    b = _single_process_guard(micro_batch=1, grad_accum=4)
    ra = a.run_step(_batch(0), _fb, lambda: _opt_step(a), step=0)
    rb = b.run_step(_batch(0), _fb, lambda: _opt_step(b), step=0)
    assert float(ra.loss) == pytest.approx(float(rb.loss), rel=1e-6)
    for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_uneven_batch_fields_are_refused_with_a_clear_message() -> None:
    guard = _single_process_guard()
    with pytest.raises(ValueError, match="one leading size"):
        guard.run_step({"x": torch.zeros(4, 8), "y": torch.zeros(3)}, _fb, lambda: None, step=0)


def _opt_step(guard: OOMGuard) -> None:
    guard.optimizer.step()
    guard.optimizer.zero_grad(set_to_none=True)


def test_comm_hook_alone_averages_like_ddp_and_counts_buckets(tmp_path: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        ref.load_state_dict(model.state_dict())
        ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
        state = install_comm_hook(ddp)
        x = torch.randn(3, 16)
        counted = []
        for _ in range(3):
            before = state.stats()["buckets"]
            ddp(x).sum().backward()
            ref(x).sum().backward()
            counted.append((state.stats()["buckets"] - before, len(state.layout)))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)  # world size 1: the average is the gradient
        # DDP starts with one bucket and rebuilds into one per layer after the first backward.
        assert counted == [(1, 1), (4, 4), (4, 4)]
        assert [b.index for b in state.layout] == [0, 1, 2, 3] and state.full_backwards == 3
        assert state.stats()["seconds"] >= 0 and state.stats()["last_bucket_t"] is not None
    finally:
        dist.destroy_process_group()


def test_one_splitter_serves_the_guard_and_the_trainer() -> None:
    from sddoctor.instrument.micro_batch import batch_size, split_batch, split_sizes
    from trainer import step

    assert step.split_batch is split_batch and step.batch_size is batch_size
    assert split_sizes(7, 3) == [3, 3, 1] and split_sizes(4, 4) == [4]
    pieces = split_batch({"x": torch.arange(7), "names": tuple("abcdefg"), "t": torch.tensor(1.0)}, 3)
    assert [p["names"] for p in pieces] == [tuple("abc"), tuple("def"), ("g",)]
    assert all(p["t"].dim() == 0 for p in pieces)
    with pytest.raises(ValueError, match="no tensor or list"):
        batch_size({"scale": 0.5, "t": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        split_batch({"x": torch.zeros(2)}, 0)
