"""Every route the server answers, in one table: the app mounts it (server/app.py), /openapi.json
documents it (each body's model, tagged by API), the API key spares its open routes, and a
router reads its path lists and each chat route's own reading of a body (kvserve/router/request.py).

A route's endpoint takes the request and the server's context (server/context.py) and returns
a Response or a JSON-able dict; path parameters are in `request.path_params`.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from kvserve.server import api_docs, insight, kv_events, status
from kvserve.server.anthropic import messages as anthropic
from kvserve.server.anthropic import protocol as anthropic_protocol
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.server.canonical import ChatTurn
from kvserve.server.ollama import embed as ollama_embed
from kvserve.server.ollama import generation as ollama
from kvserve.server.ollama import models as ollama_models
from kvserve.server.ollama import protocol as ollama_protocol
from kvserve.server.ollama.protocol import ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest
from kvserve.server.openai import (
    chat,
    completions,
    embeddings,
    models,
    render,
    responses,
    responses_protocol,
    stored_responses,
    tokens,
)
from kvserve.server.openai import protocol as openai_protocol
from kvserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from kvserve.server.openai.responses_protocol import ResponsesRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvserve.server.context import ServerContext

Endpoint = Callable[["Request", "ServerContext"], Awaitable[Any]]
API = Literal["OpenAI", "Anthropic", "Ollama", "vLLM", "kvserve"]


@dataclass(frozen=True)
class Route:
    methods: str  # "POST", "GET", "GET HEAD", "DELETE"
    path: str
    endpoint: Endpoint
    api: API = "kvserve"  # whose API it is: the docs' tag; a router forwards all but kvserve's own
    body: type[BaseModel] | None = None  # a POST body's model, described in /openapi.json
    open: bool = False  # answered without the API key: it holds nothing secret, and probes and browsers cannot send one
    documented: bool = True  # listed in /openapi.json (the docs' own files are not)
    # For a router: what a request costs a replica ("generate": its prompt and its answer; "prefill":
    # its input only), and a chat route's reading of a raw body (None where the route would refuse it).
    load: Literal["generate", "prefill"] | None = None
    chat: Callable[[dict[str, Any]], ChatTurn | None] | None = None


ROUTES: tuple[Route, ...] = (
    # OpenAI
    Route("POST", "/v1/chat/completions", chat.ChatCompletion.handle, "OpenAI", ChatCompletionRequest,
          load="generate", chat=openai_protocol.read),
    Route("POST", "/v1/completions", completions.Completion.handle, "OpenAI", CompletionRequest, load="generate"),
    Route("POST", "/v1/responses", responses.ModelResponse.handle, "OpenAI", ResponsesRequest, load="generate",
          chat=responses_protocol.read),
    Route("GET", "/v1/responses/{response_id}", stored_responses.get_response, "OpenAI"),
    Route("DELETE", "/v1/responses/{response_id}", stored_responses.delete_response, "OpenAI"),
    Route("POST", "/v1/embeddings", embeddings.Embedding.handle, "OpenAI", EmbeddingRequest, load="prefill"),
    Route("GET", "/v1/models", models.list_models, "OpenAI"),
    Route("GET", "/v1/models/{model_id:path}", models.model, "OpenAI"),
    # Anthropic
    Route("POST", "/v1/messages", anthropic.Message.handle, "Anthropic", MessagesRequest, load="generate",
          chat=anthropic_protocol.read),
    Route("POST", "/v1/messages/count_tokens", anthropic.count_tokens, "Anthropic", CountTokensRequest),
    # Ollama
    Route("POST", "/api/chat", ollama.Chat.handle, "Ollama", ChatRequest, load="generate", chat=ollama_protocol.read_chat),
    Route("POST", "/api/generate", ollama.Generate.handle, "Ollama", GenerateRequest, load="generate",
          chat=ollama_protocol.read_generate),
    Route("POST", "/api/embed", ollama_embed.Embed.handle, "Ollama", EmbedRequest),
    Route("POST", "/api/embeddings", ollama_embed.Embeddings.handle, "Ollama", EmbeddingsRequest),
    Route("POST", "/api/show", ollama_models.show, "Ollama", ShowRequest),
    Route("GET", "/api/tags", ollama_models.tags, "Ollama"),
    Route("GET", "/api/ps", ollama_models.running, "Ollama"),
    Route("GET", "/api/version", ollama_models.version, "Ollama", open=True),  # Ollama's clients probe it
    # vLLM's extras
    Route("POST", "/v1/chat/completions/render", render.render_chat, "vLLM", ChatCompletionRequest),
    Route("POST", "/tokenize", tokens.tokenize, "vLLM", TokenizeRequest),
    Route("POST", "/detokenize", tokens.detokenize, "vLLM", DetokenizeRequest),
    # kvserve's own: status, what the engine does, the cache-aware router's feed, the page, the docs
    Route("GET HEAD", "/health", status.health, open=True),
    Route("GET", "/ping", status.ping, open=True),
    Route("GET", "/version", status.version, open=True),
    Route("GET", "/metrics", status.metrics, open=True),
    Route("GET", "/v1/engine/state", insight.engine_state),
    Route("GET", "/v1/requests/{request_id}/timeline", insight.request_timeline),
    Route("GET", "/kv/events", kv_events.kv_events),
    Route("GET", "/kv/renderer", kv_events.kv_renderer),
    Route("GET", "/", insight.page, open=True),
    Route("GET", "/static/{name}", insight.static, open=True),
    Route("GET", "/docs", api_docs.docs, open=True, documented=False),
    Route("GET", "/docs/{name}", api_docs.asset, open=True, documented=False),
    Route("GET", "/openapi.json", api_docs.document, open=True, documented=False),
)


def paths(load: Literal["generate", "prefill"]) -> tuple[str, ...]:
    """The paths of the routes whose requests cost a replica `load`."""
    return tuple(r.path for r in ROUTES if r.load == load)


CHAT_READERS: dict[str, Callable[[dict[str, Any]], ChatTurn | None]] = {
    r.path: r.chat for r in ROUTES if r.chat is not None}
# The routes a router forwards beside everything under /v1/ and /api/.
FORWARDED_PATHS = tuple(r.path for r in ROUTES if r.api != "kvserve" and not r.path.startswith(("/v1/", "/api/")))
