"""Several models tried in order, for when one provider is down or rate-limited."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import attrs

from ..errors import UsageError
from ..settings import ModelSettings, merge
from ._base import Model, ModelEvent, ModelRequest, ModelResponse, ProviderError


class FallbackModel:
    """Try ``models`` in order; move to the next on a retryable failure, or when
    its server cannot be reached (a local server that is not running: refused
    at once, not retried).

    Each model has already retried as its own policy says before it counts
    as failed. A non-retryable error (a bad request, a bad key) is raised at
    once: another model would not fix the request. A stream falls back only
    before its first event; after that the caller has seen part of an
    answer, and a failure is raised. When every model fails, the last error
    is raised with a note for each earlier one. ``name`` is the first
    model's; ``ModelResponse.model`` says which one answered.

    ``settings`` gives a model its own settings (by position, ``None`` for
    none): merged under the request's, so what a run asks for wins, and a
    model can carry what only its provider knows (``extra``,
    ``reasoning_effort``) or a smaller ``max_tokens``.

    Raises:
        UsageError: no models, or ``settings`` not one per model.
    """

    def __init__(
        self,
        models: Sequence[Model],
        *,
        settings: Sequence[ModelSettings | None] | None = None,
    ) -> None:
        if not models:
            raise UsageError("FallbackModel needs at least one model")
        if settings is not None and len(settings) != len(models):
            raise UsageError(
                f"FallbackModel: settings has {len(settings)} entries for {len(models)} models"
            )
        self.models: tuple[Model, ...] = tuple(models)
        self.settings: tuple[ModelSettings | None, ...] = (
            tuple(settings) if settings is not None else (None,) * len(models)
        )

    def _request_for(self, position: int, request: ModelRequest) -> ModelRequest:
        own = self.settings[position]
        if own is None:
            return request
        # Under everything the request asks, its own max_tokens/temperature included.
        asked = ModelSettings(max_tokens=request.max_tokens, temperature=request.temperature)
        return attrs.evolve(request, settings=merge(own, asked, request.settings))

    @property
    def name(self) -> str:
        return self.models[0].name

    def __repr__(self) -> str:
        return f"FallbackModel([{', '.join(m.name for m in self.models)}])"

    async def complete(self, request: ModelRequest) -> ModelResponse:
        failures: list[str] = []
        for position, model in enumerate(self.models):
            try:
                return await model.complete(self._request_for(position, request))
            except ProviderError as exc:
                self._give_up_unless_next(position, exc, failures)
                failures.append(f"{model.name} failed first: {exc}")
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        failures: list[str] = []
        for position, model in enumerate(self.models):
            stack = contextlib.AsyncExitStack()
            try:
                events = await stack.enter_async_context(
                    model.stream(self._request_for(position, request))
                )
                first = await anext(aiter(events))
            except ProviderError as exc:
                await stack.aclose()
                self._give_up_unless_next(position, exc, failures)
                failures.append(f"{model.name} failed first: {exc}")
                continue
            except BaseException:
                await stack.aclose()
                raise
            break
        chained = _chain(first, events)
        try:
            yield chained
        finally:
            await chained.aclose()
            await stack.aclose()

    def _give_up_unless_next(self, position: int, exc: ProviderError, failures: list[str]) -> None:
        unreachable = exc.error_type == "connection_error"
        if (exc.retryable or unreachable) and position + 1 < len(self.models):
            return
        for failure in failures:
            exc.add_note(failure)
        raise exc


async def _chain(
    first: ModelEvent, rest: AsyncIterator[ModelEvent]
) -> AsyncGenerator[ModelEvent, None]:
    yield first
    async for event in rest:
        yield event
