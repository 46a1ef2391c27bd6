"""One streamed chat completion through a real server, traced: which kvserve modules it runs and
how many threads its work is handed to before its first token reaches the response. The front
door's targets: at most 25 modules and 2 crossings (docs/ARCHITECTURE.md walks the same path).

The server is kvserve's app on uvicorn with kvserve's h11 protocol, in this process (a profile
hook sees only its own process's threads), on loopback, serving the default model, on asyncio's
event loop (uvloop, not a kvserve dependency, hands work over in C, where a profile hook cannot
see it). The client is the `openai` package. After a warm-up request, one request is traced with
`threading.setprofile` (Python 3.11: no sys.monitoring).

What is counted:
- The window opens as the traced request is sent (on a new connection: the protocol's guards,
  web/protocols.py, counts) and closes when the event loop hands uvicorn the
  first body chunk whose delta carries generated text.
- A module is on the path when one of its functions runs (or a coroutine of it resumes) for the
  request in that window. Imports do not count: everything was imported, and the kernels
  compiled, before the window opened.
- Background does not count: each (thread, function) that ran while the server sat idle for a
  moment just before (the engine thread's poll of its inbox, uvicorn's tick), and what a thread
  does after its last hand-off to the event loop (the engine's next decode step while the loop
  writes the first token).
- The front door is the path less what runs inside `LLMEngine.step()`, the engine's step that
  every running request shares (scheduler, runner, model, kernels, sampler, postprocess; 21
  modules on their own): the 25-module target is the front door's, and both counts are held to
  what they are now.
- The chain of threads is the order in which threads run the request's work. A crossing is a
  hand-off of that work to a thread other than the event loop; the way back to the loop, which
  writes the response, belongs to that crossing. loop → worker → loop → engine → loop is 2
  crossings (4 hops).
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import openai
import pytest

LOOP = "kvserve-event-loop"  # the thread uvicorn runs on here
HANDOFF = "<hand-off to the event loop>"
STEP = ("kvserve.engine.engine", "LLMEngine.step")
MODEL = "smollm2-135m"
API_KEY = "path-key"
FRONT_DOOR_TARGET, MAX_CROSSINGS = 25, 2
# Measured on 2026-12-02: front door 25 modules, whole path 38, 2 crossings (4 hops); before the
# merges that brought it to its target (legacy functions into openai_compat, streaming into
# serving, framing into body, ChatPrompt into the tokenizer package; defaults resolved at
# start-up): 33 and 46; before the front-door redesign (web/, Serving, one input processor): 23
# and 36 modules, 3 crossings (6 hops). Lower these as the path shrinks; a path that grows fails.
FRONT_DOOR_NOW, WHOLE_PATH_NOW = 25, 38


class Event(NamedTuple):
    thread: str
    module: str  # or HANDOFF
    function: str
    in_step: bool  # inside LLMEngine.step()


def _carries_text(message: object) -> bool:
    """An ASGI body message holding an SSE chunk with generated text."""
    if not isinstance(message, dict) or message.get("type") != "http.response.body":
        return False
    for line in message.get("body", b"").decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            if any((c.get("delta") or {}).get("content") for c in json.loads(line[6:]).get("choices") or ()):
                return True
    return False


class Recorder:
    """A profile hook for the threads started after `threading.setprofile(recorder.hook)`: while
    `on`, the kvserve functions each thread calls, its hand-offs to the event loop, and the end
    of the window (which turns it off)."""

    def __init__(self) -> None:
        self.on = False
        self.ended = threading.Event()
        self.events: list[Event] = []
        self._steps: dict[str, object] = {}  # thread → the frame of the LLMEngine.step it is in

    def hook(self, frame, event: str, arg: object) -> None:
        if not self.on or event not in ("call", "return"):
            return
        thread = threading.current_thread().name
        if event == "return":
            if self._steps.get(thread) is frame:
                del self._steps[thread]
            return
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if module.startswith("kvserve"):
            if (module, frame.f_code.co_qualname) == STEP:
                self._steps[thread] = frame
            self.events.append(Event(thread, module, frame.f_code.co_qualname, thread in self._steps))
        elif name == "call_soon_threadsafe" and module == "asyncio.base_events":
            self.events.append(Event(thread, HANDOFF, "", False))
        elif name == "send" and module.startswith("uvicorn.protocols") and _carries_text(frame.f_locals.get("message")):
            self.on = False
            self.ended.set()

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events


def _short(module: str) -> str:
    return module.removeprefix("kvserve.")


@dataclass
class Path:
    events: list[Event]  # counted ones, in order

    @property
    def modules(self) -> list[str]:
        return sorted({e.module for e in self.events})

    @property
    def front_door(self) -> list[str]:
        return sorted({e.module for e in self.events if not e.in_step})

    @property
    def step_modules(self) -> list[str]:
        return sorted({e.module for e in self.events if e.in_step})

    @property
    def chain(self) -> list[list[Event]]:
        """The events in runs on one thread."""
        runs: list[list[Event]] = []
        for e in self.events:
            if runs and runs[-1][0].thread == e.thread:
                runs[-1].append(e)
            else:
                runs.append([e])
        return runs

    @property
    def crossings(self) -> int:
        return sum(run[0].thread != LOOP for run in self.chain[1:])

    def describe(self) -> str:
        chain = self.chain
        lines = [f"front door, {len(self.front_door)} modules: {', '.join(map(_short, self.front_door))}",
                 f"in the engine step, {len(self.step_modules)}: {', '.join(map(_short, self.step_modules))}",
                 f"whole path: {len(self.modules)} modules; {self.crossings} crossings, {len(chain) - 1} hops:"]
        for run in chain:
            modules = ", ".join(dict.fromkeys(_short(e.module) for e in run))
            lines.append(f"  {run[0].thread}: {_short(run[0].module)}.{run[0].function} .. "
                         f"{_short(run[-1].module)}.{run[-1].function} [{modules}]")
        return "\n".join(lines)


def request_path(events: list[Event], background: set[tuple[str, str, str]]) -> Path:
    """The counted events of a window (see the module docstring)."""
    last_handoff = {e.thread: i for i, e in enumerate(events) if e.module == HANDOFF and e.thread != LOOP}
    return Path([e for i, e in enumerate(events)
                 if e.module != HANDOFF and e[:3] not in background
                 and (e.thread == LOOP or i < last_handoff.get(e.thread, len(events)))])


@pytest.fixture(scope="module")
def traced() -> Path:
    import uvicorn

    from kvserve.config import CacheConfig
    from kvserve.generation_defaults import resolve
    from kvserve.llm import LLM
    from kvserve.model.loader import resolve_model_path
    from kvserve.server.app import build_app
    from kvserve.server.lifecycle import EngineServer
    from kvserve.server.settings import ServerSettings
    from kvserve.web.protocols import h11_options
    from server_harness import free_port

    recorder = Recorder()
    threading.setprofile(recorder.hook)  # before the engine, event loop and worker threads start
    server = thread = None
    try:
        llm = LLM(MODEL, cache=CacheConfig(memory_bytes=64 << 20))
        port = free_port()
        settings = ServerSettings(model_name=MODEL, port=port, api_key=API_KEY,
                                  sampling_defaults=resolve(resolve_model_path(MODEL)))
        app = build_app(settings, llm=llm)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_config=None,
                                server_header=False,
                                **h11_options(settings.header_timeout, settings.max_connections,
                                              logging.getLogger("kvserve.server")))
        server = EngineServer(config, app.state.ctx.state, settings.drain_timeout)
        thread = threading.Thread(target=server.run, name=LOOP, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=settings.url + "/v1", api_key=API_KEY, max_retries=0)

        def chat(content: str) -> str:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    max_tokens=4, temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        assert chat("Name a colour.")  # warm-up: first-use costs stay out of the window
        assert app.state.ctx.grammars.started.wait(60)  # and the grammar processes' start (grammar_pool.py)
        recorder.on = True  # the idle server's own work is background
        time.sleep(1.5)
        recorder.on = False
        background = {e[:3] for e in recorder.take() if e.module != HANDOFF}
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1.0)  # threads then change where one waits (a hand-off), not every 5 ms
        try:
            recorder.on = True
            text = chat("Name a fruit.")
        finally:
            recorder.on = False
            sys.setswitchinterval(switch)
        assert text and recorder.ended.is_set(), "no chunk with generated text was seen leaving the server"
        path = request_path(recorder.take(), background)
        print(path.describe())
        return path
    finally:
        threading.setprofile(None)
        if server is not None:
            server.should_exit = True
            thread.join(30)


@pytest.mark.slow
def test_the_path_grows_no_module(traced):
    assert {"kvserve.server.openai.chat", "kvserve.engine.async_engine"} <= set(traced.front_door)
    assert len(traced.front_door) <= FRONT_DOOR_NOW, traced.describe()
    assert len(traced.modules) <= WHOLE_PATH_NOW, traced.describe()


@pytest.mark.slow
def test_the_front_door_meets_its_target(traced):
    assert len(traced.front_door) <= FRONT_DOOR_TARGET, traced.describe()


@pytest.mark.slow
def test_the_engine_step_never_calls_the_http_side(traced):
    assert {"kvserve.engine.runner", "kvserve.engine.sampler", "kvserve.model.llama"} <= set(traced.step_modules)
    http = [m for m in traced.step_modules if m.startswith(("kvserve.server", "kvserve.web"))]
    assert not http, traced.describe()


@pytest.mark.slow
def test_the_request_crosses_few_threads(traced):
    threads = [run[0].thread for run in traced.chain]
    assert threads[0] == threads[-1] == LOOP, traced.describe()  # in and out on the event loop
    assert "kvserve-engine" in threads, traced.describe()
    assert traced.crossings <= MAX_CROSSINGS, traced.describe()
