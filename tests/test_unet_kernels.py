"""benchmarks.unet_kernels on CPU: its GroupNorm variants compute what nn.GroupNorm computes (so
its timings compare equal work), and bad arguments or a missing GPU exit 2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import unet_kernels


@pytest.mark.parametrize("variant", [unet_kernels.PrimitiveGroupNorm, unet_kernels.NhwcGroupNorm])
@pytest.mark.parametrize("channels_last", [True, False])
def test_group_norm_variants_match_nn_group_norm_forward_and_backward(variant, channels_last):
    torch.manual_seed(0)
    norm = nn.GroupNorm(8, 32)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(3, 32, 6, 5) * 4 + 2
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    grad = torch.randn(3, 32, 6, 5)
    expected = norm(x)
    expected.backward(grad)
    grads = (x.grad.clone(), norm.weight.grad.clone(), norm.bias.grad.clone())
    x.grad, norm.weight.grad, norm.bias.grad = None, None, None
    norm.__class__ = variant
    got = norm(x)
    got.backward(grad)
    torch.testing.assert_close(got, expected)
    for mine, theirs in zip((x.grad, norm.weight.grad, norm.bias.grad), grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_unknown_variant_or_no_gpu_exits_2(capsys):
    assert unet_kernels.main(["--norm-variants", "native,bogus"]) == 2
    assert "unknown part or variant: bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert unet_kernels.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
