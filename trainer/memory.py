"""Lower-precision training state: bf16 UNet weights, bf16 optimizer state, and what they need.

An fp32 UNet under bf16 autocast keeps 16 bytes per parameter (weights, gradients, two Adam
moments, all fp32) and casts every weight to bf16 on every forward; GroupNorm runs in fp32 under
autocast, so activations go back and forth between fp32 and bf16 around every norm layer. Keeping
the UNet itself in bf16 removes the casts and halves weights and gradients; the optimizer then
decides what precision the update has:

    MixedPrecisionAdamW(params, master_weights=True)            fp32 master copy + fp32 moments
        the update is computed and accumulated in fp32, exactly AdamW on the master copy, and
        written to the bf16 weights by rounding: 4 + 2 + 2 + 8 = 16 bytes per parameter
    MixedPrecisionAdamW(params, master_weights=False, state_dtype=torch.bfloat16)
        no master copy, bf16 moments, stochastic rounding of the updated weights (an unbiased
        rounding, so updates far below bf16's resolution still move the weights on average):
        2 + 2 + 4 = 8 bytes per parameter, what `train.memory_saver` uses

For fp32 parameters with fp32 state it is plain AdamW (decoupled weight decay), and matches
`torch.optim.AdamW` to rounding (tests/test_perf_memory.py).

The update runs over chunks of tensors, so its fp32 copies (of bf16 gradients, and without a
master copy of the weights and moments) are bounded by `chunk_elements` rather than by the model
size; they live in `Float32Workspace`s, filled by one multi-tensor copy per chunk. With fp32 moments and a master copy
(the default) each chunk is one call of torch's fused AdamW kernel on the master copy (`fused`,
on by default on CUDA): on SD2-base it replaces a chain of eight multi-tensor passes over the
fp32 state that cost 23 ms per step on an H200. Otherwise the update is a chain of torch._foreach
ops, which also handles bf16 moments and stochastic rounding.

`CastInputs` wraps a bf16 UNet so that the fp32 latents the objective builds enter it in bf16
(a bf16 convolution refuses fp32 input); autocast is then off for the UNet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch


def unet_weights_bf16(unet_dtype: str, optimizer: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the UNet's weights are bf16: `model.unet_dtype=bf16`, or `auto` when training in
    bf16 on CUDA with an optimizer that keeps an fp32 master copy (not 8-bit AdamW)."""
    if unet_dtype == "auto":
        return dtype == torch.bfloat16 and device.type == "cuda" and optimizer == "adamw"
    return unet_dtype == "bf16"


def _round_bits_(bits: torch.Tensor, generator: torch.Generator | None) -> None:
    """Stochastic rounding of fp32 values to bf16, in place on their int32 view: bf16 is the upper half
    of an fp32 bit pattern, so adding a uniform random 16-bit integer to the lower half and clearing
    it rounds up exactly with the probability the lower half represents (an unbiased rounding)."""
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32, generator=generator)
    bits.add_(noise).bitwise_and_(-65536)  # keep the upper 16 bits


def stochastic_round_to_bf16(
    source: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Write fp32 `source` into bf16 `out`, rounding up with probability equal to the dropped fraction."""
    bits = source.contiguous().view(torch.int32).clone()
    _round_bits_(bits, generator)
    out.copy_(bits.view(torch.float32))  # exact: the lower bits are zero


def chunk_slices(tensors: Sequence[torch.Tensor], chunk_elements: int) -> Iterator[slice]:
    """Consecutive slices of `tensors` of at most `chunk_elements` elements each (a tensor larger than
    that gets a slice of its own): the unit of work of the multi-tensor updates here, bounding their
    fp32 workspaces."""
    start, size = 0, 0
    for i, t in enumerate(tensors):
        if size and size + t.numel() > chunk_elements:
            yield slice(start, i)
            start, size = i, 0
        size += t.numel()
    if start < len(tensors):
        yield slice(start, len(tensors))


class Staged(NamedTuple):
    """fp32 stand-ins for a list of tensors (`views`), laid end to end in one flat tensor (`flat`)."""

    views: list[torch.Tensor]
    flat: torch.Tensor


class Float32Workspace:
    """A flat fp32 buffer, reused by every chunk and step, for fp32 copies of lists of tensors.

    Casting a model's bf16 gradients with one `.float()` per tensor costs the host about 30 us a
    tensor: some 20 ms a step for SD2-base's 700 tensors, while the GPU, done with the backward
    pass, waits (measured with `train.profile_steps`). Here the copies are views into one buffer,
    made once per list (keyed by the tensors they stand for) and filled by one multi-tensor copy;
    being end to end, they also form one flat tensor that whole-chunk operations can use. The
    buffer grows to the largest list asked for and stays: `chunk_elements` x 4 bytes at most.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._staged: dict[tuple[int, ...], Staged] = {}

    def views(self, like: Sequence[torch.Tensor]) -> Staged:
        """Uninitialised fp32 tensors with the shapes and strides of `like` (cached by identity)."""
        key = tuple(id(t) for t in like)
        staged = self._staged.get(key)
        if staged is not None:
            return staged
        total = sum(t.numel() for t in like)
        device = like[0].device
        if self._buffer is None or self._buffer.numel() < total or self._buffer.device != device:
            self._staged.clear()
            self._buffer = None  # free the old buffer before taking the larger one
            self._buffer = torch.empty(total, dtype=torch.float32, device=device)
        views, offset = [], 0
        for t in like:
            dense = t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            stride = t.stride() if dense else torch.empty(t.shape, device="meta").stride()
            views.append(self._buffer.as_strided(t.shape, stride, offset))
            offset += t.numel()
        if len(self._staged) >= 256:  # lists that stopped recurring (another set of tensors with grads)
            self._staged.clear()
        staged = Staged(views, self._buffer[:total])
        self._staged[key] = staged
        return staged

    def copy(self, sources: list[torch.Tensor], like: Sequence[torch.Tensor]) -> Staged:
        """fp32 copies of `sources`, laid out as `like` (stable tensors: the cache key; `sources`
        such as gradients may be new tensors every step)."""
        staged = self.views(like)
        _copy_all(staged.views, sources)
        return staged


def stochastic_round_staged(
    targets: list[torch.Tensor], staged: Staged, generator: torch.Generator | None = None
) -> None:
    """Round the fp32 values of `staged` (overwritten) stochastically into the bf16 `targets`, as
    `stochastic_round_to_bf16` does, with one random draw and one copy for the whole list."""
    _round_bits_(staged.flat.view(torch.int32), generator)
    _copy_all(targets, staged.views)  # exact: the lower bits are zero


class MixedPrecisionAdamW(torch.optim.Optimizer):
    """AdamW for bf16 (or fp32) parameters with an fp32 master copy or bf16 state; see the module doc."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = True,
        state_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = True,
        chunk_elements: int = 1 << 25,
        fused: bool | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.chunk_elements = chunk_elements
        #: None: the fused kernel on CUDA where torch has it; True/False: always/never where it applies
        self.fused = fused
        # fp32 copies of bf16 gradients, weights and moments, one chunk at a time (not state: not saved)
        self._grads32 = Float32Workspace()
        self._weights32 = Float32Workspace()
        self._moments32 = (Float32Workspace(), Float32Workspace())
        self._step_tensors: dict[torch.device, torch.Tensor] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but state tensors keep their own dtype (torch casts them to the parameter's:
        a bf16 parameter would get its fp32 master copy rounded to bf16 on resume)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[int(index)]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[param][key] = value.to(device=param.device, copy=True)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=self.state_dtype, memory_format=torch.preserve_format
            )
            if self.master_weights and p.dtype != torch.float32:
                state["master"] = p.detach().float().clone()
        return state

    def _chunks(self, params: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
        for part in chunk_slices(params, self.chunk_elements):
            yield params[part]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            states = {id(p): self._state(p) for p in params}
            for p in params:
                states[id(p)]["step"] += 1
            # One step count per group keeps the foreach math uniform (all params step together).
            step = states[id(params[0])]["step"]
            bias1 = 1 - beta1**step
            bias2_sqrt = math.sqrt(1 - beta2**step)
            fused = self._fused_applies(params, states)
            step_tensors: dict[torch.device, torch.Tensor] = {}
            for chunk in self._chunks(params):
                chunk_states = [states[id(p)] for p in chunk]
                if fused:
                    device = chunk[0].device
                    if device not in step_tensors:
                        step_tensors[device] = self._step_tensor(device, step)
                    self._fused_update(chunk, chunk_states, step_tensors[device], lr, beta1, beta2, eps, wd)
                else:
                    self._update(chunk, chunk_states, lr, beta1, beta2, eps, wd, bias1, bias2_sqrt)
        return loss

    def _step_tensor(self, device: torch.device, step: int) -> torch.Tensor:
        """The step count on `device` for the fused kernel: one tensor, refilled by a kernel each
        step, rather than a new one copied from host memory (a pageable copy that waits)."""
        tensor = self._step_tensors.get(device)
        if tensor is None:
            tensor = self._step_tensors[device] = torch.zeros((), dtype=torch.float32, device=device)
        return tensor.fill_(float(step))

    def _fused_applies(self, params: list[torch.Tensor], states: dict[int, dict[str, Any]]) -> bool:
        """fp32 moments and fp32 weights to update (a master copy or fp32 parameters), one device
        type, a torch with the fused kernel, and the kernel asked for (or CUDA, by default)."""
        if self.fused is False or self.state_dtype != torch.float32 or not hasattr(torch, "_fused_adamw_"):
            return False
        if any("master" not in states[id(p)] and p.dtype != torch.float32 for p in params):
            return False
        device_types = {p.device.type for p in params}
        if len(device_types) != 1:
            return False
        return self.fused is True or device_types == {"cuda"}

    def _fused_update(
        self,
        params: list[torch.Tensor],
        states: list[dict[str, Any]],
        step: torch.Tensor,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        wd: float,
    ) -> None:
        """torch's fused AdamW on the fp32 weights, then the bf16 parameters rounded from them."""
        weights = [s.get("master", p) for p, s in zip(params, states, strict=True)]
        # The kernel wants one dtype across its lists, and the gradients laid out as the weights; it
        # may also write into the gradients it is given, so they go in as fp32 copies and the
        # parameters' own .grad stays intact.
        grads = self._grads32.copy([p.grad for p in params], like=weights).views  # type: ignore[misc]
        torch._fused_adamw_(
            weights,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [step] * len(params),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        rounded = [(p, w) for p, w in zip(params, weights, strict=True) if w is not p]
        if rounded:
            _copy_all([p for p, _ in rounded], [w for _, w in rounded])

    def _update(
        self,
        params: list[torch.Tensor],
        states: list[dict[str, Any]],
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        wd: float,
        bias1: float,
        bias2_sqrt: float,
    ) -> None:
        grad_list: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        if all(g.dtype == torch.float32 for g in grad_list):
            grads = grad_list
        else:
            grads = self._grads32.copy(grad_list, like=params).views
        # The fp32 weights to update: the master copies, or fp32 parameters in place; otherwise
        # (bf16 parameters without a master copy) fp32 copies, rounded back into them at the end.
        in_place = all("master" in s or p.dtype == torch.float32 for p, s in zip(params, states, strict=True))
        staged: Staged | None = None
        if in_place:
            weights = [s["master"] if "master" in s else p for p, s in zip(params, states, strict=True)]
        else:
            staged = self._weights32.copy(params, like=params)
            weights = staged.views
        fp32_state = self.state_dtype == torch.float32
        if fp32_state:
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
        else:
            m = self._moments32[0].copy([s["exp_avg"] for s in states], like=params).views
            v = self._moments32[1].copy([s["exp_avg_sq"] for s in states], like=params).views
        if wd:
            torch._foreach_mul_(weights, 1 - lr * wd)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, m, denom, -lr / bias1)
        if not fp32_state:
            _copy_all([s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states], m + v)
        if in_place:
            masters = [(p, s["master"]) for p, s in zip(params, states, strict=True) if "master" in s]
            if masters:
                _copy_all([p for p, _ in masters], [w for _, w in masters])  # nearest rounding
        elif staged is not None:
            if not self.stochastic_rounding:
                _copy_all(params, weights)  # nearest rounding
            elif all(p.dtype == torch.bfloat16 for p in params):
                stochastic_round_staged(params, staged)
            else:  # bf16 and other parameters in one list
                for p, w in zip(params, weights, strict=True):
                    if p.dtype == torch.bfloat16:
                        stochastic_round_to_bf16(w, p)
                    else:
                        p.copy_(w)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for all i; one multi-tensor launch where torch has it."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(targets, sources)
    else:  # pragma: no cover - older torch
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)


class CastInputs(torch.nn.Module):
    """Runs `module` on floating-point inputs cast to `dtype` (positional and keyword tensors)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*(self._cast(a) for a in args), **{k: self._cast(v) for k, v in kwargs.items()})


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's state tensors (for memory reports)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
