"""Code that lives inside each rank process: collective tracing, heartbeat, OOM guard, fault injection.

Importing `sddoctor.instrument` itself is cheap; the submodules that need torch import it.
"""
