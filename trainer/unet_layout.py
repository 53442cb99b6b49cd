"""A channels_last UNet whose activations stay channels_last: diffusers' NCHW copies taken out.

Two places in diffusers' UNet blocks turn a channels_last activation into an NCHW-contiguous copy:

- `ResnetBlock2D`, in training mode, calls `input_tensor.contiguous()` before its 1x1 shortcut
  convolution (a guard against DDP's gradient-stride warning on NCHW models). That is a full copy
  of the block's input in every block whose channel count changes: in SD's UNet every resnet of
  the up-blocks (whose input is the concatenation with the skip connection) and the first resnet
  of two down-blocks, 14 of 22.
- `Transformer2DModel` ends with `reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous()`: the
  permuted tensor is already channels_last, and `.contiguous()` copies it to NCHW, after which
  the residual add and the next block's convolution read the two layouts mixed.

Under torch.compile such a copy is fused with its neighbours (the resnet's GroupNorm + SiLU) into
pointwise kernels that write one layout while reading the other, neighbouring threads C elements
apart: the slowest memory-bound kernels of the step (docs/performance.md, "Speed, step 2"), with
transposed gradients in the backward.

`keep_channels_last(unet)` gives those modules a forward that computes what diffusers' does
without the copies (for the resnet block: diffusers' own evaluation-mode path, which already
skips it). Modules of other kinds (an up/down-sampling resnet, `scale_shift` time embeddings,
patched or vectorised transformer inputs) keep diffusers' code. Parameters, state dict,
checkpoints and the exported pipeline are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.transformers.transformer_2d import Transformer2DModel


class ChannelsLastResnetBlock(ResnetBlock2D):
    """ResnetBlock2D whose shortcut convolution reads the block's input in its own layout."""

    def forward(
        self, input_tensor: torch.Tensor, temb: torch.Tensor | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        hidden = self.conv1(self.nonlinearity(self.norm1(input_tensor)))
        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]
        if temb is not None:
            hidden = hidden + temb
        hidden = self.conv2(self.dropout(self.nonlinearity(self.norm2(hidden))))
        shortcut = input_tensor if self.conv_shortcut is None else self.conv_shortcut(input_tensor)
        return (shortcut + hidden) / self.output_scale_factor


class ChannelsLastTransformer(Transformer2DModel):
    """Transformer2DModel whose output is the (B, H, W, C) tokens viewed as NCHW: channels_last."""

    def _get_output_for_continuous_inputs(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        batch_size: int,
        height: int,
        width: int,
        inner_dim: int,
    ) -> torch.Tensor:
        if self.use_linear_projection:
            hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
        if not self.use_linear_projection:
            hidden_states = self.proj_out(hidden_states)
        return hidden_states + residual


def _resnet_supported(block: torch.nn.Module) -> bool:
    return (
        type(block) is ResnetBlock2D
        and block.time_embedding_norm == "default"
        and block.upsample is None
        and block.downsample is None
    )


def _transformer_supported(block: torch.nn.Module) -> bool:
    return type(block) is Transformer2DModel and bool(block.is_input_continuous)


def keep_channels_last(unet: torch.nn.Module) -> int:
    """Give every supported resnet block and transformer of `unet` its copy-free forward; returns
    how many modules changed."""
    changed = 0
    for module in unet.modules():
        if _resnet_supported(module):
            module.__class__ = ChannelsLastResnetBlock  # same parameters and buffers, other forward
        elif _transformer_supported(module):
            module.__class__ = ChannelsLastTransformer
        else:
            continue
        changed += 1
    return changed
