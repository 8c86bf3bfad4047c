"""``provider:model`` strings to models."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import httpx

from .._providers import HTTP_PROVIDERS
from ..errors import UsageError
from ._anthropic import AnthropicModel
from ._base import Model
from ._budget import ModelBudget
from ._fallback import FallbackModel
from ._gemini import GeminiModel
from ._http import HTTPModel
from ._openai import OpenAIModel
from ._prices import Price
from ._retry import RetryPolicy
from ._scripted import scripted_model

#: The adapter of each name in ``kernel._providers.HTTP_PROVIDERS``, in its order
#: (a test checks the two agree): a new provider is its module and a line here.
ADAPTERS: Mapping[str, type[HTTPModel]] = {
    cls.provider: cls for cls in (OpenAIModel, AnthropicModel, GeminiModel)
}
PROVIDERS: tuple[str, ...] = (*HTTP_PROVIDERS, "scripted")


def resolve_model(
    spec: str,
    *,
    client: httpx.AsyncClient | None = None,
    fallbacks: Sequence[str] = (),
    retry: RetryPolicy | None = None,
    env: Mapping[str, str] | None = None,
    prices: Mapping[str, Price] | None = None,
    budget: ModelBudget | None = None,
) -> Model:
    """The model a ``provider:model`` string names, with ``fallbacks`` behind it.

    Providers: ``openai``, ``anthropic``, ``gemini`` (over ``client``, which
    the caller owns: see ``open_http_client``) and ``scripted`` (no network:
    ``scripted:demo``, ``scripted:echo``, or a name given to
    ``register_scripted_model``). ``env`` (``os.environ`` by default) gives
    ``{PROVIDER}_API_KEY`` and ``{PROVIDER}_BASE_URL``; the key may be left
    out when the base URL points at a local or private-network server (a
    vLLM, Ollama or llama.cpp server). With ``fallbacks``, the result is a
    ``FallbackModel`` trying the models in order. ``prices`` adds to or
    overrides the built-in price table. ``budget`` is the ``ModelBudget``
    every HTTP request of the models (fallbacks included) waits for.

    Raises:
        UsageError: an unknown provider (the message lists the known ones),
            a missing API key (the message names the variable), a bad base
            URL, or an HTTP provider without ``client``.
    """
    environ = os.environ if env is None else env
    models = [
        _resolve_one(s, client=client, retry=retry, env=environ, prices=prices, budget=budget)
        for s in (spec, *fallbacks)
    ]
    return models[0] if len(models) == 1 else FallbackModel(models)


def _resolve_one(
    spec: str,
    *,
    client: httpx.AsyncClient | None,
    retry: RetryPolicy | None,
    env: Mapping[str, str],
    prices: Mapping[str, Price] | None,
    budget: ModelBudget | None,
) -> Model:
    provider, colon, model = spec.partition(":")
    known = ", ".join(PROVIDERS)
    if not colon or not model:
        raise UsageError(
            f"model {spec!r}: write provider:model, e.g. openai:gpt-4.1-mini (providers: {known})"
        )
    if provider == "scripted":
        return scripted_model(model)
    if provider not in ADAPTERS:
        raise UsageError(f"model {spec!r}: unknown provider {provider!r}; known providers: {known}")
    factory = ADAPTERS[provider]
    default_url = factory.default_base_url
    prefix = provider.upper()
    base_url = env.get(f"{prefix}_BASE_URL") or default_url
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{prefix}_BASE_URL={base_url!r} is not an http(s) URL")
    api_key = env.get(f"{prefix}_API_KEY") or None
    if api_key is None and not _is_local(parts.hostname):
        raise UsageError(
            f"model {spec!r} needs an API key: set {prefix}_API_KEY "
            f"(or point {prefix}_BASE_URL at a local server)"
        )
    if client is None:
        raise UsageError(
            f"model {spec!r} needs an httpx.AsyncClient: pass client= (see open_http_client)"
        )
    built = factory(
        model, client=client, api_key=api_key, base_url=base_url, retry=retry, prices=prices
    )
    # Set after: GeminiModel's own __init__ does not take budget= (yet).
    built.budget = budget
    return built


def _is_local(host: str) -> bool:
    """Whether ``host`` is this machine or a private network, where servers often want no key."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private
