"""GPU and host data layer (NVML through pynvml, psutil). No UI code and no torch here.

nvml        the one NVML loader (shared)
samples     plain records: GpuSample, ProcessSample, HostSample, GpuSnapshot
source      GpuSource protocol, NvmlSource, PcieSampler (PCIe off the sampling path)
throttle    clock-event (throttle) reasons decoded to words
host        psutil: host figures and who each GPU process is
collector   one sampling round + history for sparklines
ranks       rank state from telemetry (pure)
rankfeeds   rank telemetry from a run directory or `sddoctor run` HTTP endpoints
matching    which GPU process is which rank
overview    everything one screen shows; the `--json` document
"""
