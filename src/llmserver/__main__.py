"""`python -m llmserver` runs the CLI."""

from llmserver.cli import main

main()
