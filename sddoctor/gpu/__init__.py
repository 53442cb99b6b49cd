"""GPU and host data layer (NVML through pynvml, psutil). No UI code and no torch here.

nvml        the one NVML loader (shared)
samples     plain records: GpuSample, ProcessSample, HostSample, GpuSnapshot
source      GpuSource protocol, NvmlSource, PcieSampler (PCIe off the sampling path)
throttle    clock-event (throttle) reasons decoded to words
host        psutil: host figures and who each GPU process is
collector   one sampling round + history for sparklines
pci_sysfs   PCIe facts from sysfs (link, ACS, IOMMU group)
topology    GPUs and the links between each pair (NVML, sysfs)

Which GPU process is which rank, and what each rank does, is `sddoctor.ranks`.
"""
