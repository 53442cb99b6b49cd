"""sddoctor: diagnose multi-GPU Stable Diffusion training.

Importing this package is cheap: it never imports torch. Subpackages that need torch
(`sddoctor.instrument`, `sddoctor.preflight.bandwidth`) import it themselves.
"""

__version__ = "0.1.0"
