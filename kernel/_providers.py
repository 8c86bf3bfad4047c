"""The model providers ``tak`` speaks to over HTTP, by name: the one list.

``resolve_model`` (``provider:model``), ``[budget.<provider>]`` of tak.toml and
``tak tools --format`` read it; each name has its adapter in
``kernel.models._resolve.ADAPTERS`` (tests/models/test_providers.py checks the
two agree). It lives on the base floor, with no imports, so the config's checks
(floor 2) and ``tak --help`` read it without loading the adapters or httpx.
"""

from __future__ import annotations

from typing import Final

#: In the order they are listed to a user.
HTTP_PROVIDERS: Final = ("openai", "anthropic", "gemini")

__all__ = ["HTTP_PROVIDERS"]
