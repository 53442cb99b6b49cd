"""trainer.unet_layout: a channels_last UNet computes what diffusers' does, without NCHW copies."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import spawn_collecting
from trainer.models import ARCHITECTURES
from trainer.unet_layout import ChannelsLastResnetBlock, ChannelsLastTransformer, keep_channels_last


class NchwCopies(TorchDispatchMode):
    """Records every copy of a 4-D tensor into NCHW-contiguous memory (what `.contiguous()` of a
    channels_last tensor does)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten.clone.default and kwargs.get("memory_format") == torch.contiguous_format:
            if args[0].dim() == 4:
                self.shapes.append(tuple(args[0].shape))
        return func(*args, **kwargs)


def tiny_unet(linear_projection: bool) -> UNet2DConditionModel:
    torch.manual_seed(0)
    kwargs = dict(ARCHITECTURES["tiny"]["unet"], use_linear_projection=linear_projection)
    return UNet2DConditionModel(**kwargs).to(memory_format=torch.channels_last)  # type: ignore[call-overload]


def inputs(unet: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    unet = getattr(unet, "module", unet)  # DDP's wrapped model
    generator = torch.Generator().manual_seed(1)
    sample = torch.randn(3, 4, 16, 16, generator=generator).contiguous(memory_format=torch.channels_last)
    context = torch.randn(3, 5, unet.config.cross_attention_dim, generator=generator)
    return sample, torch.tensor([3, 400, 900]), context


def step(unet: torch.nn.Module, copies: NchwCopies | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward + backward; the output and every parameter's gradient."""
    unet.zero_grad(set_to_none=True)
    sample, timesteps, context = inputs(unet)
    with copies if copies is not None else warnings.catch_warnings():
        out = unet(sample, timesteps, context).sample
        out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in unet.parameters()]


@pytest.mark.parametrize("linear_projection", [True, False], ids=["sd2-linear-proj", "sd15-conv-proj"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_same_outputs_and_gradients_without_nchw_copies(linear_projection: bool, training: bool) -> None:
    theirs = tiny_unet(linear_projection).train(training)
    ours = copy.deepcopy(theirs)
    resnets = sum(type(m) is ResnetBlock2D for m in theirs.modules())
    transformers = sum(type(m) is Transformer2DModel for m in theirs.modules())
    assert keep_channels_last(ours) == resnets + transformers  # every one of the tiny UNet's
    assert sum(type(m) is ChannelsLastTransformer for m in ours.modules()) == transformers == 4

    their_copies, our_copies = NchwCopies(), NchwCopies()
    their_out, their_grads = step(theirs, their_copies)
    our_out, our_grads = step(ours, our_copies)

    torch.testing.assert_close(our_out, their_out, rtol=1e-5, atol=1e-6)
    for ours_g, theirs_g in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(ours_g, theirs_g, rtol=1e-5, atol=1e-6)
    # diffusers copies each transformer's output (and in training each shortcut's input) to NCHW
    shortcuts = sum(getattr(m, "conv_shortcut", None) is not None for m in theirs.modules())
    assert len(their_copies.shapes) >= transformers + shortcuts * training
    assert our_copies.shapes == []
    assert our_out.is_contiguous(memory_format=torch.channels_last)


def test_blocks_it_does_not_cover_keep_diffusers_forward() -> None:
    upsampling = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=8, groups=4, up=True)
    scale_shift = ResnetBlock2D(
        in_channels=8, out_channels=16, temb_channels=8, groups=4, time_embedding_norm="scale_shift"
    )
    plain = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=8, groups=4)
    holder = torch.nn.ModuleList([upsampling, scale_shift, plain])
    assert keep_channels_last(holder) == 1
    assert type(upsampling) is ResnetBlock2D and type(scale_shift) is ResnetBlock2D
    assert type(plain) is ChannelsLastResnetBlock
    # a second call changes nothing more
    assert keep_channels_last(holder) == 0


def test_state_dict_and_saved_folder_are_unchanged(tmp_path) -> None:
    unet = tiny_unet(True)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    keep_channels_last(unet)
    after = unet.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    unet.save_pretrained(tmp_path / "unet")
    reloaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    assert all(type(m) is not ChannelsLastResnetBlock for m in reloaded.modules())


def _ddp_rank(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        unet = tiny_unet(True)
        keep_channels_last(unet)
        model = torch.nn.parallel.DistributedDataParallel(unet, gradient_as_bucket_view=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                step(model)
        grads = torch.cat([p.grad.reshape(-1) for p in unet.parameters()])
        gathered = [torch.zeros_like(grads) for _ in range(2)]
        torch.distributed.all_gather(gathered, grads)
        results[rank] = {
            "warnings": [str(w.message) for w in caught if "stride" in str(w.message).lower()],
            "grads_equal": bool(torch.equal(gathered[0], gathered[1])),
        }
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_with_gradient_bucket_views_gives_no_stride_warning() -> None:
    """The reason diffusers copies the shortcut's input: DDP's warning that a gradient's strides
    differ from its bucket view's. A channels_last UNet trained through DDP does not raise it."""
    results = spawn_collecting(_ddp_rank, 2)
    assert results[0] == results[1] == {"warnings": [], "grads_equal": True}


@pytest.mark.parametrize(
    ("settings", "ours"),
    [({}, True), ({"keep_channels_last": False}, False), ({"channels_last": False}, False)],
    ids=["default", "keep_channels_last-off", "channels_last-off"],
)
def test_the_trainer_uses_it_with_channels_last_unless_turned_off(settings: dict, ours: bool) -> None:
    from trainer.build import load_models
    from trainer.config import Config
    from trainer.process import Dist

    cfg = Config()
    for name, value in settings.items():
        setattr(cfg.model, name, value)
    dist = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    models = load_models(cfg, dist, torch.float32, lambda _message: None)[0]
    kinds = {type(m) for m in models.unet.modules()}
    assert (ChannelsLastResnetBlock in kinds and ChannelsLastTransformer in kinds) is ours
    assert (ResnetBlock2D in kinds) is not ours
