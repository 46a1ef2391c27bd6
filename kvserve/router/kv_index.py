"""The precise source of cache_aware: the block hashes each replica says it holds.

Each replica publishes `GET /kv/events` (kvserve/server/kv_events.py): its model file, block
size, the fingerprint of its chat renderer, and the chained SHA-256 of every full block it stores
or evicts. The router follows it, loads kvserve's own Tokenizer from the same model file (and, if
the replica renders chats otherwise, its chat template and special-token rule from
`/kv/renderer`), renders a request to the server's own ChatPrompt, and hashes its tokens with
the KV manager's own walk, so a match here is what the replica will find. A replica whose
rendering the router cannot reproduce (the fingerprints still differ) is routed by text instead.

Between routing a request and the replica publishing its blocks (its prefill plus one poll)
the router would not know them yet; a burst of requests with a new shared prefix would then
scatter. So the blocks of a routed prompt count as "pending" on that replica while the request
is in flight and for a short grace after, until the replica's own events confirm or drop them.

A replica that publishes its events over ZMQ in vLLM's format (`kvserve serve
--kv-events-endpoint`) names the endpoint in that answer; the router then takes the answer as its
starting state and follows the stream instead of polling (kvserve/router/kv_stream.py,
kv_zmq.py), back to a full answer whenever the stream cannot go on. Replicas without it are
polled as before.

What a replica says is bounded (kvserve/router/kv_page.py): its answer's bytes, the hashes it
may hold, the shape of every field; the body is parsed on a worker thread. A replica that
breaks a rule is taken out (`mark_down`, with a log line) and its blocks forgotten.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvserve.fim import encode_fim
from kvserve.kv.block_pool import prefix_block_hashes
from kvserve.router.kv_blocks import ReplicaBlocks
from kvserve.router.kv_page import BrokenRule, apply_events, parse_page, read_body
from kvserve.router.kv_stream import StreamSource
from kvserve.router.replicas import HEALTHY, Replica
from kvserve.router.request import RoutedRequest
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.chat_template import ChatPrompt

log = logging.getLogger("kvserve.router")


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain the replica would look up (kvserve/kv/block_pool.py's walk, shared)."""
    return [h for h, _ in prefix_block_hashes(token_ids, block_size)]


@dataclass(frozen=True)
class Renderer:
    """How one replica turns a request into prompt ids."""
    tokenizer: Tokenizer
    special_tokens_in_content: bool = False


class KVIndex:
    def __init__(self, client: httpx.AsyncClient, poll_interval: float, api_key: str | None,
                 pending_grace: float = 1.0, max_bytes: int = 24 << 20, max_held: int = 1 << 18,
                 mark_down: Callable[[Replica, str], None] = lambda replica, why: None,
                 stream_check: float = 5.0) -> None:
        self.client = client
        self.poll_interval = poll_interval
        self.max_bytes = max_bytes  # of one /kv/events answer
        self.max_held = max_held  # block hashes one replica may say it holds
        self.mark_down = mark_down
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.pending_grace = pending_grace
        self.blocks: dict[Replica, ReplicaBlocks] = {}
        self._tokenizers: dict[str, asyncio.Future[Tokenizer | None]] = {}  # per model file
        self._renderers: dict[str, Renderer | None] = {}  # per renderer fingerprint
        self._renderer_notes: dict[str, str] = {}  # why a fingerprint has no renderer here
        self._tasks: dict[Replica, asyncio.Task] = {}
        self._first_read: dict[Replica, asyncio.Event] = {}  # set once the first answer was taken in (or failed)
        self.streams = StreamSource(client, self.headers, max_bytes, max_held, max(poll_interval, 0.05), stream_check)

    # -- following replicas -----------------------------------------------------------------
    def follow(self, replica: Replica) -> None:
        if replica not in self._tasks:
            self._first_read[replica] = asyncio.Event()
            self._tasks[replica] = asyncio.create_task(self._follow(replica), name=f"kv-events {replica.url}")

    async def first_reads(self, timeout: float) -> list[Replica]:
        """Wait (at most timeout seconds) until every followed replica's first /kv/events answer is
        in and its tokenizer loaded, or known not to come; the replicas still unread then. A router
        answering before would route its first burst blind: the requests of one new prefix would
        scatter over the replicas, each computing it (the blocks of a prompt routed somewhere count
        there only once the prompt can be hashed)."""
        waits = {r: asyncio.ensure_future(e.wait()) for r, e in self._first_read.items()}
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout)
        for w in waits.values():
            w.cancel()
        return [r for r, e in self._first_read.items() if not e.is_set()]

    def forget(self, replica: Replica) -> None:
        task = self._tasks.pop(replica, None)
        if task is not None:
            task.cancel()
        self.blocks.pop(replica, None)
        self._first_read.pop(replica, None)
        self.streams.forget(replica)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        self.streams.close()

    def usable(self, replica: Replica) -> ReplicaBlocks | None:
        """The replica's blocks, if it publishes them and its tokenizer is loaded here."""
        b = self.blocks.get(replica)
        if b is None or self._renderers.get(b.renderer) is None:
            return None
        return b

    async def _follow(self, replica: Replica) -> None:
        while not replica.removed:
            wait = self.poll_interval
            if replica.state != HEALTHY:
                self.blocks.pop(replica, None)  # it may come back empty (restarted)
                self._read(replica)  # nothing to wait for
                await asyncio.sleep(wait)
                continue
            try:
                try:
                    wait = await self._poll(replica)
                finally:
                    self._read(replica)
                b = self.blocks.get(replica)
                if b is not None and b.stream is not None and b.renderer in self._renderers:  # (renderer settled)
                    await self.streams.follow(replica, b, functools.partial(self._current, replica, b),
                                              b.prune_pending)
                    b.seq = 0  # so the next answer is a full one (the stream's and the log's numbers differ)
                    wait = self.poll_interval  # then a full answer, and the stream again
            except BrokenRule as e:
                self.blocks.pop(replica, None)
                replica.extra["kv_events"] = f"broke the rules: {e}"
                replica.extra["blocks_held"] = 0
                log.warning("%s: its /kv/events broke the rules (%s): taken out", replica.url, e)
                self.mark_down(replica, f"/kv/events broke the rules: {e}")
            except (httpx.HTTPError, TimeoutError) as e:
                log.debug("kv events of %s: %s", replica.url, e)
            except Exception:  # following a replica must survive anything
                log.exception("kv events of %s failed", replica.url)
            await asyncio.sleep(wait)

    def _read(self, replica: Replica) -> None:
        if (first := self._first_read.get(replica)) is not None:
            first.set()

    async def _poll(self, replica: Replica) -> float:
        b = self.blocks.get(replica)
        async with asyncio.timeout(10.0):  # the whole answer, however slowly it trickles
            async with self.client.stream("GET", replica.url + "/kv/events", params={"since": b.seq if b else 0},
                                          headers=self.headers, timeout=5.0) as r:
                if r.status_code == 404:  # an older kvserve, or another server: the text tree it is
                    replica.extra["kv_events"] = "not published"
                    return 30.0
                if r.status_code in (401, 403):
                    replica.extra["kv_events"] = f"refused ({r.status_code}): give the router --replica-api-key"
                    return 5.0
                if r.status_code != 200:
                    return self.poll_interval
                body = await read_body(r, self.max_bytes)
        page = await asyncio.to_thread(parse_page, body, self.max_held)
        data = page.fields
        if not data.get("caching", True):
            replica.extra["kv_events"] = "prefix caching off"
            self.blocks.pop(replica, None)
            return 30.0
        renderer = data.get("renderer") or f"model:{data['model']}"
        if b is None or b.instance != data["instance"] or b.model != data["model"] or b.renderer != renderer:
            b = ReplicaBlocks(data["model"], data["block_size"], data["instance"], renderer)
            self.blocks[replica] = b
        if b.renderer not in self._renderers:
            await self._load_renderer(b, replica)
        if page.held is not None:
            b.held = page.held
        elif page.events is not None:  # (parse_page: exactly one of them)
            await asyncio.to_thread(apply_events, b.held, page.events, self.max_held)
        b.seq = data["seq"]
        if "kv_events_endpoint" in data:
            b.stream = (data["kv_events_endpoint"], data.get("kv_events_replay_endpoint"),
                        data.get("kv_events_topic", ""), data.get("kv_events_seq", -1))
        b.prune_pending()
        replica.extra["kv_events"] = ("followed" if self._renderers.get(b.renderer)
                                      else self._renderer_notes.get(b.renderer, "no tokenizer here"))
        replica.extra["blocks_held"] = len(b.held)
        return self.poll_interval

    def _current(self, replica: Replica, b: ReplicaBlocks) -> bool:
        return replica.state == HEALTHY and not replica.removed and self.blocks.get(replica) is b

    async def _load_tokenizer(self, model: str, replica: Replica) -> Tokenizer | None:
        """One attempt per model file, awaited by every replica that uses it: a replica read while
        another's load was under way used to take it for failed and be routed by text for good."""
        if model not in self._tokenizers:
            self._tokenizers[model] = asyncio.ensure_future(self._load_tokenizer_once(model, replica))
        return await asyncio.shield(self._tokenizers[model])  # (a replica that leaves stops no one's load)

    async def _load_tokenizer_once(self, model: str, replica: Replica) -> Tokenizer | None:
        try:
            tokenizer = await asyncio.to_thread(Tokenizer.load, model)
        except Exception as e:  # noqa: BLE001 - the model file is on another host: fall back
            log.warning("cache_aware: cannot load the tokenizer of %s from %s (%s); using the text it "
                        "was sent instead", replica.url, model, e)
            return None
        log.info("cache_aware (precise): tokenizer of %s loaded from %s", replica.url, model)
        return tokenizer

    async def _load_renderer(self, b: ReplicaBlocks, replica: Replica) -> None:
        """Render as the replica does: its model file's tokenizer, with its chat template and
        special-token rule where they differ from the file's; only once the fingerprints agree."""
        key = b.renderer
        base = await self._load_tokenizer(b.model, replica)
        if base is None:
            self._renderers[key] = None
            return
        if key.startswith("model:") or await asyncio.to_thread(base.fingerprint) == key:
            self._renderers[key] = Renderer(base)  # (a replica that names no fingerprint: its file's)
            return
        r = await self.client.get(replica.url + "/kv/renderer", headers=self.headers, timeout=5.0)
        if r.status_code != 200:  # a transient failure: asked again at the next poll
            return
        try:
            info = r.json()
            template, special = info["chat_template"], info["special_tokens_in_messages"]
            if not isinstance(template, str) or len(template) > 1 << 20 or not isinstance(special, bool):
                raise ValueError("chat_template must be a string under 1 MiB, special_tokens_in_messages a bool")
            tok = await asyncio.to_thread(base.with_chat_template, template)
            same = await asyncio.to_thread(tok.fingerprint, special) == key
        except Exception as e:  # noqa: BLE001 - a template that does not compile here, a bad answer
            same, why = False, f"its /kv/renderer is not usable ({e})"
        else:
            why = "its tokenizer differs from the model file's here"
        if same:
            self._renderers[key] = Renderer(tok, special)
            log.info("cache_aware (precise): %s renders chats with its own template; rendering as it does", replica.url)
        else:
            self._renderers[key] = None
            self._renderer_notes[key] = f"routed by text: {why}"
            log.warning("cache_aware: %s renders prompts in a way the router cannot reproduce (%s): routed "
                        "by text", replica.url, why)

    # -- requests ---------------------------------------------------------------------------
    async def prepare(self, req: RoutedRequest) -> None:
        """Tokenize and hash the prompt once per renderer the replicas use (on a thread: a long
        prompt takes a millisecond or more, which the event loop should not wait for)."""
        keys = {(b.renderer, b.block_size) for b in self.blocks.values() if self._renderers.get(b.renderer)}
        if keys and req.routable:
            await asyncio.to_thread(self._prepare, req, keys)

    def _prepare(self, req: RoutedRequest, keys: set[tuple[str, int]]) -> None:
        prepare_hashes(req, {renderer: r for renderer, _ in keys if (r := self._renderers[renderer]) is not None}, keys)

    def hashes(self, req: RoutedRequest, b: ReplicaBlocks) -> list[bytes] | None:
        """The prompt's block hashes for this replica's renderer (None: not prepared for it)."""
        return req.hashes.get((b.renderer, b.block_size))

    def prompt_tokens(self, req: RoutedRequest) -> int | None:
        return len(next(iter(req.token_ids.values()))) if req.token_ids else None

    def mark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        if (b := self.blocks.get(replica)) is not None:
            b.mark_pending(hashes)

    def unmark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        if (b := self.blocks.get(replica)) is not None:
            b.unmark_pending(hashes, time.monotonic() + self.pending_grace + self.poll_interval)


def prepare_hashes(req: RoutedRequest, renderers: dict[str, Renderer], keys: set[tuple[str, int]]) -> None:
    """req's prompt ids per renderer and block hashes per (renderer, block size), as each replica
    will see them; what a request already has is kept (it may be routed again)."""
    chat = req.chat_prompt()
    for renderer, block_size in keys:
        if renderer not in req.token_ids:
            req.token_ids[renderer] = encode_prompt(req, chat, renderers[renderer])
        req.hashes[(renderer, block_size)] = block_hashes(req.token_ids[renderer], block_size)


def encode_prompt(req: RoutedRequest, chat: ChatPrompt | None, renderer: Renderer) -> list[int]:
    """The prompt's token ids as the replica will see them."""
    if isinstance(req.prompt, list):
        return req.prompt
    if isinstance(req.prompt, str) and req.suffix:
        try:
            return encode_fim(renderer.tokenizer, req.prompt, req.suffix)
        except ValueError:  # no FIM markers: the replica answers this one with its own 400
            return []
    if isinstance(req.prompt, str):
        return renderer.tokenizer.encode(req.prompt)
    if chat is not None:
        try:
            return renderer.tokenizer.encode_prompt(chat, renderer.special_tokens_in_content)
        except ValueError:  # the replica answers this one with its own 400
            return []
    return []
