"""`python -m bench`: the catalogue of bench commands, or a group of them in turn (bench/commands.py)."""

from bench.commands import main

raise SystemExit(main())
