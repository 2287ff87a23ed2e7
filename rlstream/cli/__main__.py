"""``python -m rlstream.cli ...``: the same commands as the ``rlstream`` script."""
from rlstream.cli.app import main

main()
