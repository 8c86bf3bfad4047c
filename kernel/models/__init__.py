"""Language models: one protocol, adapters for OpenAI, Anthropic and Gemini, and a scripted model.

``resolve_model("openai:gpt-4.1-mini", client=client)`` gives a ``Model``;
``async with model.stream(request) as events`` streams its answer and
``await model.complete(request)`` waits for it. Each adapter owns its provider's
tool format (``openai_tools``, ``anthropic_tools``, ``gemini_tools``, fed
``kernel.tools.ToolDefinition`` records). A ``ModelBudget`` given to
``resolve_model(..., budget=)`` holds every HTTP request of its models to
shared limits per provider and model, and shares ``Retry-After`` between
them. ``ReplayModel`` answers from a recorded session. See docs/models.md.

This package imports httpx: ``import kernel`` does not import it.
"""

from ._anthropic import AnthropicModel as AnthropicModel
from ._anthropic import anthropic_tools as anthropic_tools
from ._base import STOP_REASONS as STOP_REASONS
from ._base import Model as Model
from ._base import ModelEvent as ModelEvent
from ._base import ModelRequest as ModelRequest
from ._base import ModelResponse as ModelResponse
from ._base import ProviderError as ProviderError
from ._base import ResponseComplete as ResponseComplete
from ._base import StopReason as StopReason
from ._base import TextDelta as TextDelta
from ._base import ToolCallDelta as ToolCallDelta
from ._base import Usage as Usage
from ._budget import BudgetLimits as BudgetLimits
from ._budget import Grant as Grant
from ._budget import ModelBudget as ModelBudget
from ._budget import ProviderLoad as ProviderLoad
from ._fallback import FallbackModel as FallbackModel
from ._gemini import GeminiModel as GeminiModel
from ._gemini import gemini_tools as gemini_tools
from ._http import open_http_client as open_http_client
from ._openai import OpenAIModel as OpenAIModel
from ._openai import openai_tools as openai_tools
from ._prices import PRICES as PRICES
from ._prices import Price as Price
from ._prices import find_price as find_price
from ._replay import ReplayModel as ReplayModel
from ._resolve import PROVIDERS as PROVIDERS
from ._resolve import resolve_model as resolve_model
from ._retry import RetryPolicy as RetryPolicy
from ._scripted import ScriptedModel as ScriptedModel
from ._scripted import register_scripted_model as register_scripted_model

__all__ = [
    "PRICES",
    "PROVIDERS",
    "STOP_REASONS",
    "AnthropicModel",
    "BudgetLimits",
    "FallbackModel",
    "GeminiModel",
    "Grant",
    "Model",
    "ModelBudget",
    "ModelEvent",
    "ModelRequest",
    "ModelResponse",
    "OpenAIModel",
    "Price",
    "ProviderError",
    "ProviderLoad",
    "ReplayModel",
    "ResponseComplete",
    "RetryPolicy",
    "ScriptedModel",
    "StopReason",
    "TextDelta",
    "ToolCallDelta",
    "Usage",
    "anthropic_tools",
    "find_price",
    "gemini_tools",
    "open_http_client",
    "openai_tools",
    "register_scripted_model",
    "resolve_model",
]
