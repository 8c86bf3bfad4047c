"""``tak mcp ls``: not built yet (issue 15)."""

from __future__ import annotations

import argparse

from ..errors import UsageError


def run(args: argparse.Namespace) -> int:
    raise UsageError("tak mcp ls is not built yet (issue 15)")
