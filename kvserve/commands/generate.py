"""`kvserve generate`: one prompt, or an offline JSONL batch through the engine."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvserve.commands.options import add_model_args, add_sampling_args
from kvserve.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt, or a JSONL file of prompts")
    add_model_args(p)
    add_sampling_args(p, max_tokens=128)
    p.add_argument("prompt", nargs="?", help="the prompt (omit with --input)")
    p.add_argument("--input", type=Path, help='JSONL: one {"prompt": ...} or {"messages": [...]} per line, optional sampling fields')
    p.add_argument("--output", type=Path, help="JSONL results (default: standard output)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(func=run)


def _read_jsonl(path, defaults: dict) -> tuple[list[SamplingParams], list[dict]]:
    """Each line's sampling parameters and record, checked before any model loads: a bad file
    fails in a second, not after the load."""
    params, records = [], []
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the `with` below, outside this try
    except OSError as e:
        raise ValueError(f"cannot read --input {path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("each line must be a JSON object")
                if not (isinstance(rec.get("messages"), list) or isinstance(rec.get("prompt"), str)):
                    raise ValueError('each line needs "prompt" (a string) or "messages" (a list)')
                unknown = set(rec) - _PARAM_FIELDS - {"prompt", "messages", "id"}
                if unknown:
                    raise ValueError(f"unknown fields {sorted(unknown)}")
                sp = SamplingParams(**{**defaults, **{k: v for k, v in rec.items() if k in _PARAM_FIELDS}})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            params.append(sp)
            records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return params, records


def _prompts(path, llm, records: list[dict]) -> list:
    """Each record's prompt: its text, or its messages in the model's chat template."""
    out = []
    for lineno, rec in enumerate(records, 1):
        try:
            out.append(llm.encode_chat(rec["messages"]) if "messages" in rec else rec["prompt"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: record {lineno}: {e}") from None
    return out


def run(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a prompt or --input prompts.jsonl")
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.input is not None:
        plist, records = _read_jsonl(args.input, defaults)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantize, activations=args.activations)
    if args.prompt is not None:
        prompt = llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        params = SamplingParams(**defaults)
        if args.output is None:  # stream to the terminal through the seed's loop
            from kvserve.chat import stream_local

            if args.chat:
                for piece in stream_local(llm, [{"role": "user", "content": args.prompt}], params):
                    print(piece, end="", flush=True)
            else:
                out = llm.generate(prompt, params)[0]
                print(out.text, end="")
            print()
            return 0
        prompts, plist, records = [prompt], [params], [{"prompt": args.prompt}]
    else:
        prompts = _prompts(args.input, llm, records)
    outs = llm.generate(prompts, plist)
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115 - closed below
    try:
        for rec, out in zip(records, outs):
            row = {"id": rec.get("id"), "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                   "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)}
            if len(out.outputs) > 1:
                row["choices"] = [{"text": c.text, "finish_reason": c.finish_reason} for c in out.outputs]
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0
