"""`python -m specdec` runs the CLI with every subcommand registered."""

from specdec.cli import main

main()
