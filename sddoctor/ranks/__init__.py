"""The ranks of a run as a monitor sees them: what each one does, and which GPU process it is.

status      what each rank is doing, derived from its telemetry (pure): `RankStatus`, `derive`
feeds       rank telemetry from a run directory or `sddoctor run` HTTP endpoints
matching    which GPU process is which rank
overview    everything one screen shows (GPUs, ranks, alerts); the `--json` document

It sits between the GPU data layer (`sddoctor.gpu`, which knows no rank) and the screen
(`sddoctor.tui`); no torch and no UI code here.
"""
