"""The floor of `make bench-peers`: transformers' `generate` behind a minimal OpenAI-style server.

What a user gets by wrapping a Hugging Face model in a web server without a serving engine: one
request at a time (a lock), no batching, no paged KV cache, tokens streamed as `generate` makes
them. It runs in its own environment (torch, transformers, fastapi, uvicorn), so it imports
nothing from kvserve:  python hf_server.py --model DIR --port 8001 --threads 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer


class _QueueStreamer:
    """transformers' streamer protocol: put(ids) per step (the prompt first), end() at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, value.flatten().tolist())

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def build_app(model_dir: str, name: str) -> FastAPI:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lock = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt", "")
        max_tokens = int(body.get("max_tokens") or 16)
        min_tokens = max_tokens if body.get("ignore_eos") else int(body.get("min_tokens") or 0)
        ids = tok(prompt, return_tensors="pt").input_ids
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())

        def chunk(text: str, finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": name,
                                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"

        async def generate():
            async with lock:  # one request at a time: this is the floor
                queue: asyncio.Queue = asyncio.Queue()
                streamer = _QueueStreamer(asyncio.get_running_loop(), queue)
                kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=min_tokens, do_sample=False,
                              streamer=streamer, pad_token_id=tok.eos_token_id)
                threading.Thread(target=lambda: model.generate(ids, **kwargs), daemon=True).start()
                n = 0
                while (new := await queue.get()) is not None:
                    n += len(new)
                    yield chunk(tok.decode(new))
                yield chunk("", "length" if n >= max_tokens else "stop")
                usage = {"prompt_tokens": ids.shape[1], "completion_tokens": n, "total_tokens": ids.shape[1] + n}
                yield "data: " + json.dumps({"id": rid, "object": "text_completion", "model": name, "choices": [],
                                             "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(generate(), media_type="text/event-stream")
        text = ""
        async for part in generate():
            data = part.removeprefix("data: ").strip()
            if data != "[DONE]" and json.loads(data)["choices"]:
                text += json.loads(data)["choices"][0]["text"]
        return JSONResponse({"id": rid, "object": "text_completion", "model": name,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--served-model-name", default="model")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(build_app(args.model, args.served_model_name), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
