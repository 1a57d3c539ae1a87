"""torchrun --nproc-per-node N bench/run.py [--hidden 5120] [--rows 1 16 128] ... (see lamport_mhc.bench)."""

import sys

from lamport_mhc.bench import main

if __name__ == "__main__":
    sys.exit(main())
