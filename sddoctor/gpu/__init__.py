"""GPU and host data layer (NVML through pynvml, psutil). No UI code and no torch here."""
