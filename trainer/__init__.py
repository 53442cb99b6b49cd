"""The bundled, instrumented DDP Stable Diffusion trainer (`python -m trainer`)."""
