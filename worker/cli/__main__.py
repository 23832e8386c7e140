"""``python -m worker.cli``: the same command line as the ``fleetmend`` console script."""

from worker.cli.app import main

main()
