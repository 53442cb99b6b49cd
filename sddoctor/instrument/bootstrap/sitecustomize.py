"""Imported by Python at start-up in every process of a job run by `sddoctor run`.

It starts the watchdog that ends the process when its supervisor is gone
(`sddoctor.instrument.orphan`), instruments rank processes (`sddoctor.instrument.boot.bootstrap`)
and then runs the
sitecustomize that would have run without us, if there is one further down sys.path.
It must never break the interpreter: every failure is reported on stderr and ignored.
"""

import os
import sys


def _sddoctor_orphan_watch():
    try:
        from sddoctor.instrument.orphan import start

        start()
    except Exception as exc:  # noqa: BLE001
        print(f"sddoctor: supervisor watchdog disabled in pid {os.getpid()}: {exc!r}", file=sys.stderr)


def _sddoctor_bootstrap():
    try:
        from sddoctor.instrument.boot import bootstrap

        bootstrap()
    except Exception as exc:  # noqa: BLE001
        print(f"sddoctor: instrumentation disabled in pid {os.getpid()}: {exc!r}", file=sys.stderr)


def _chain_user_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - what site.py would do for the user's own file
        print(f"Error in sitecustomize ({spec.origin}); ignored: {exc!r}", file=sys.stderr)


_sddoctor_orphan_watch()
_sddoctor_bootstrap()
_chain_user_sitecustomize()
