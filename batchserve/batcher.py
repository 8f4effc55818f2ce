"""Moved to `batchserve/core/batcher.py` (issue 23); kept because ../shared/DESIGN.md names this file. Nothing in
the package imports it."""

from batchserve.core.batcher import *  # noqa: F403
