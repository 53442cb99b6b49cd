"""`python -m trainer` / `torchrun -m trainer`: see `python -m trainer --help`."""

from trainer.train import main

raise SystemExit(main())
