"""Runs ``examples/dreams/as_is.py`` as its users do, under 2 DDP processes on the CPU.

Usage: ``python dreams_as_is_ddp.py VARIANT [VARIANT ...]`` in a folder holding ``spectra.hdf5``; the variants run
one after the other in the same two processes (as a script that fits twice), and each rank writes
``VARIANT_rank{r}.json`` there.
"""

from __future__ import annotations

import sys

from examples.dreams.as_is import main

if __name__ == "__main__":
    for variant in sys.argv[1:]:
        main(
            [
                "--variant", variant, "--devices", "2", "--max_steps", "4", "--root_dir", variant,
                "--data_path", "spectra.hdf5", "--result", variant + "_rank",
            ]
        )  # fmt: skip
