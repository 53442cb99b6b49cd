"""trainer.memory: MixedPrecisionAdamW against torch.optim.AdamW, stochastic rounding, CastInputs."""

from __future__ import annotations

import pytest
import torch

from trainer.memory import (
    CastInputs,
    Float32Workspace,
    MixedPrecisionAdamW,
    chunk_slices,
    optimizer_state_bytes,
    stochastic_round_staged,
    stochastic_round_to_bf16,
)


def _problem(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, torch.randn(64, 16), torch.randn(64, 4)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x, y, steps: int = 30) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fp32_matches_torch_adamw():
    ref, x, y = _problem()
    ours, _, _ = _problem()
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    _train(ref, torch.optim.AdamW(ref.parameters(), **kw), x, y)
    # a tiny chunk size: several foreach chunks per step
    _train(ours, MixedPrecisionAdamW(ours.parameters(), chunk_elements=100, **kw), x, y)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_weights_with_fp32_master_track_torch_adamw():
    ref, x, y = _problem()
    ours, _, _ = _problem()
    ours.to(torch.bfloat16)
    kw = dict(lr=3e-3, weight_decay=0.01)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), **kw), x, y)
    opt = MixedPrecisionAdamW(ours.parameters(), master_weights=True, **kw)
    our_losses = _train(ours, opt, x, y)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        master = opt.state[b]["master"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, a, rtol=0, atol=0.03)  # bf16 gradients, fp32 accumulation
        assert torch.equal(b, master.to(torch.bfloat16))
    assert our_losses[-1] < 0.8 * our_losses[0]
    assert our_losses[-1] == pytest.approx(ref_losses[-1], rel=0.1)


def test_bf16_state_without_master_halves_state_and_still_trains():
    model, x, y = _problem()
    model.to(torch.bfloat16)
    opt = MixedPrecisionAdamW(model.parameters(), lr=3e-3, master_weights=False, state_dtype=torch.bfloat16)
    losses = _train(model, opt, x, y)
    params = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(opt) == 2 * 2 * params  # two bf16 moments, no master copy
    assert losses[-1] < 0.8 * losses[0]


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_loses_the_update():
    # 1 + 2**-10 lies an eighth of the way from 1 to the next bf16 value (1 + 2**-7)
    source = torch.full((200_000,), 1.0 + 2**-10)
    out = torch.empty_like(source, dtype=torch.bfloat16)
    stochastic_round_to_bf16(source, out, generator=torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    assert source.to(torch.bfloat16).float().mean().item() == 1.0  # what nearest rounding does
    negative = torch.full((200_000,), -(1.0 + 2**-10))
    stochastic_round_to_bf16(negative, out, generator=torch.Generator().manual_seed(1))
    assert out.float().mean().item() == pytest.approx(-(1.0 + 2**-10), abs=2e-5)


def test_bad_settings_raise():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="state_dtype"):
        MixedPrecisionAdamW(p, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="invalid AdamW"):
        MixedPrecisionAdamW(p, lr=-1.0)


def test_cast_inputs_feeds_a_bf16_module_fp32_tensors():
    layer = torch.nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        layer(torch.randn(3, 4))
    wrapped = CastInputs(layer, torch.bfloat16)
    assert wrapped(torch.randn(3, 4)).dtype == torch.bfloat16
    assert list(wrapped.parameters()) == list(layer.parameters())


def test_state_dict_round_trip_keeps_fp32_master_and_moments():
    model, x, y = _problem()
    model.to(torch.bfloat16)
    opt = MixedPrecisionAdamW(model.parameters(), lr=3e-3, master_weights=True)
    _train(model, opt, x, y, steps=3)
    twin, _, _ = _problem()
    twin.to(torch.bfloat16).load_state_dict(model.state_dict())
    fresh = MixedPrecisionAdamW(twin.parameters(), lr=3e-3, master_weights=True)
    fresh.load_state_dict(opt.state_dict())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh.state[q][key].dtype == torch.float32
            assert torch.equal(fresh.state[q][key], opt.state[p][key])
        assert fresh.state[q]["step"] == 3
    # training continues identically from the restored state
    _train(model, opt, x, y, steps=2)
    _train(twin, fresh, x, y, steps=2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_matches_the_foreach_update(dtype: torch.dtype) -> None:
    """The fused AdamW kernel (CUDA's default, forced here on the CPU) against the foreach chain."""
    (a, x, y), (b, _, _) = _problem(), _problem()
    a.to(dtype)
    b.to(dtype)
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, chunk_elements=100)
    foreach = MixedPrecisionAdamW(a.parameters(), fused=False, **kw)
    fused = MixedPrecisionAdamW(b.parameters(), fused=True, **kw)
    _train(a, foreach, x, y, steps=20)
    _train(b, fused, x, y, steps=19)
    loss = torch.nn.functional.mse_loss(b(x.to(dtype)).float(), y)
    loss.backward()
    grads = [p.grad.clone() for p in b.parameters()]
    fused.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(b.parameters(), grads, strict=True))  # .grad untouched
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
        if dtype == torch.bfloat16:
            torch.testing.assert_close(
                foreach.state[pa]["master"], fused.state[pb]["master"], rtol=1e-5, atol=1e-6
            )


def test_ema_in_chunks_is_the_plain_moving_average() -> None:
    from trainer.optim import EMA

    model, _, _ = _problem()
    start = [p.detach().clone() for p in model.parameters()]
    ema = EMA(model, decay=0.9, chunk_elements=100)  # several chunks
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for s, p0, p in zip(ema.shadow, start, model.parameters(), strict=True):
        torch.testing.assert_close(s, 0.9 * p0 + 0.1 * p)


def test_bf16_ema_keeps_moves_far_below_bf16_resolution() -> None:
    """decay 0.9999 moves the average by 1e-6 a step here, 1/8000 of bf16's step at 1.0: nearest
    rounding would never move; stochastic rounding follows the fp32 average on the mean."""
    from trainer.optim import EMA

    model = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    fp32, bf16 = EMA(model, 0.9999), EMA(model, 0.9999, dtype=torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0078125)  # the next bf16 value above 1.0
    for _ in range(2000):
        fp32.update()
        bf16.update()
    (shadow,) = bf16.shadow
    assert shadow.dtype == torch.bfloat16
    moved = fp32.shadow[0].mean().item() - 1.0  # about 0.0014
    assert moved > 0.001
    assert shadow.float().mean().item() - 1.0 == pytest.approx(moved, rel=0.1)
    nearest = torch.ones(64, dtype=torch.bfloat16)
    for _ in range(100):
        nearest = torch.lerp(nearest.float(), torch.full((64,), 1.0078125), 1e-4).to(torch.bfloat16)
    assert torch.equal(nearest, torch.ones(64, dtype=torch.bfloat16))  # what plain rounding would do


def test_chunks_stay_under_the_limit_unless_one_tensor_is_larger() -> None:
    tensors = [torch.empty(n) for n in (30, 30, 50, 200, 10, 10)]
    parts = [[t.numel() for t in tensors[part]] for part in chunk_slices(tensors, 100)]
    assert parts == [[30, 30], [50], [200], [10, 10]]


def test_workspace_views_keep_layout_and_lie_end_to_end() -> None:
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last).to(torch.bfloat16)
    like = [conv.weight, conv.bias]
    workspace = Float32Workspace()
    staged = workspace.copy([p.detach() for p in like], like=like)
    assert [v.shape for v in staged.views] == [p.shape for p in like]
    assert staged.views[0].stride() == conv.weight.stride() != conv.weight.contiguous().stride()
    assert all(v.dtype == torch.float32 for v in staged.views)
    assert torch.equal(staged.views[0], conv.weight.float()) and torch.equal(
        staged.views[1], conv.bias.float()
    )
    assert staged.flat.numel() == sum(p.numel() for p in like)
    assert staged.views[1].data_ptr() == staged.flat.data_ptr() + 4 * conv.weight.numel()
    assert workspace.views(like) is staged  # made once per list
    bigger = [torch.zeros(1000, dtype=torch.bfloat16)]
    assert workspace.copy(bigger, like=bigger).flat.numel() == 1000  # grows, forgets the old views
    assert workspace.views(like) is not staged


def test_staged_stochastic_rounding_matches_the_per_tensor_rounding() -> None:
    sources = [torch.full((500, 400), 1.0 + 2**-10), torch.full((200_000,), -(1.0 + 2**-9))]
    targets = [torch.empty_like(t, dtype=torch.bfloat16) for t in sources]
    staged = Float32Workspace().copy(sources, like=sources)
    stochastic_round_staged(targets, staged, generator=torch.Generator().manual_seed(0))
    assert set(targets[0].float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert targets[0].float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-5)
    assert targets[1].float().mean().item() == pytest.approx(-(1.0 + 2**-9), abs=2e-5)


@pytest.mark.parametrize("master_weights", [True, False])
def test_channels_last_convolutions_update_alike_fused_and_foreach(master_weights: bool) -> None:
    """Gradients enter the kernels as fp32 views laid out as the weights; a channels_last weight
    must pair each gradient element with its own weight element, in both update paths."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 1)
        )
        return net.to(memory_format=torch.channels_last).to(torch.bfloat16)

    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    nets, losses = [model(), model(), model()], []
    kw = dict(lr=1e-2, master_weights=master_weights, stochastic_rounding=False, chunk_elements=200)
    optimizers = [
        MixedPrecisionAdamW(nets[0].parameters(), fused=False, **kw),
        MixedPrecisionAdamW(nets[1].parameters(), fused=True, **kw),
    ]
    for net, opt in zip(nets, optimizers, strict=False):
        for _ in range(5):
            loss = net(x.to(torch.bfloat16)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # a contiguous copy of the same net, plain per-tensor math: the layout must not matter
    reference = nets[2].to(memory_format=torch.contiguous_format)
    ref_opt = MixedPrecisionAdamW(reference.parameters(), fused=False, **kw)
    for _ in range(5):
        loss = reference(x.contiguous().to(torch.bfloat16)).float().square().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for a, b, c in zip(nets[0].parameters(), nets[1].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.float(), c.float(), rtol=0, atol=2e-2)
        if master_weights:
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
