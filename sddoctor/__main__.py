import sys

from sddoctor.cli import main

sys.exit(main())
