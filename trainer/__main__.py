"""`python -m trainer` / `torchrun -m trainer`: see `python -m trainer --help`."""

from trainer import exit_if_stack_missing

exit_if_stack_missing()

from trainer.train import main  # noqa: E402  (after the check: it imports the stack)

raise SystemExit(main())
