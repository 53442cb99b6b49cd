"""A small CUDA load for scripts/gpu/tui.sh: a bf16 matmul loop on one GPU that reports
itself as rank 0 of a 1-rank run through sddoctor.instrument.api, so the monitor can match
the NVML process to the rank by pid and show its step, loss and it/s.

usage: python scripts/gpu/tui_workload.py RUN_DIR SECONDS
"""

from __future__ import annotations

import sys
import time

import torch

from sddoctor.instrument import api as sdi


def main() -> int:
    run_dir, seconds = sys.argv[1], float(sys.argv[2])
    torch.cuda.set_device(0)
    sdi.enable(run_dir, rank=0, local_rank=0, world_size=1, device="cuda:0", backend="none")
    sdi.update_state(device="cuda:0")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    hold = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # 4 GiB more, easy to spot  # noqa: F841
    print("ready", flush=True)
    end = time.time() + seconds
    step = 0
    while time.time() < end:
        t0 = time.time()
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
        sdi.step(step, loss=float(c[0, 0].float().abs().log1p()), samples=20, step_time=time.time() - t0)
        step += 1
    sdi.disable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
