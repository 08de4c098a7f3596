"""``hf-dspark generate``: a streaming chat (or one ``--prompt``) with the target, drafting with a DSpark drafter.

Ctrl-C during a reply stops that reply and returns to the prompt; the chat keeps every completed turn (the
interrupted one is dropped, so the next message continues from the last complete exchange). Ctrl-C at the
prompt asks for a second one; a second Ctrl-C in a row exits with code 130, Ctrl-D or an empty line with 0.
"""

from __future__ import annotations

import argparse
import sys

from .arguments import positive_float, positive_int, probability

INTERRUPTED = 130
QUIT_HINT = "(Ctrl-C again, Ctrl-D or an empty line to quit)"


def add_generate(sub) -> None:
    p = sub.add_parser("generate", allow_abbrev=False,
                       help="Chat with streaming output; prints tok/s and τ after each reply.",
                       description="Chat (or one --prompt) with the target, drafting with a DSpark drafter. Greedy "
                                   "output is exactly the target's own. Ctrl-C stops a reply and keeps the chat.")
    p.add_argument("--prompt", default=None, help="one-shot prompt (default: interactive chat)")
    p.add_argument("--target", default=None, help="target directory or Hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--drafter", default=None, help="drafter directory or Hub id, any supported format")
    p.add_argument("--no-draft", action="store_true", help="plain decoding, for comparison")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--sample", action="store_true", help="sample (lossless: rejection sampling) instead of greedy")
    p.add_argument("--temperature", type=positive_float, default=0.7, help="with --sample")
    p.add_argument("--top-p", type=probability, default=0.95, help="with --sample")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from ..generation.chat import ChatSession
    from ..loading import load_drafter, load_target, raise_if_bad_paths

    raise_if_bad_paths(args.target, [None if args.no_draft else args.drafter])  # before minutes of loading
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype)
    drafter = None if args.no_draft else load_drafter(args.drafter, target).model
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.sample else {}
    session = ChatSession(target, tokenizer, drafter, system_prompt=args.system, max_new_tokens=args.max_new_tokens,
                          generation_kwargs=sampling)
    if args.prompt is not None:
        return 0 if _reply(session, tokenizer, args.prompt) else INTERRUPTED
    return run_chat(session, tokenizer)


def run_chat(session, tokenizer) -> int:
    """The interactive loop; returns the exit code (0: Ctrl-D or an empty line, 130: two Ctrl-C in a row)."""
    print("hf-dspark chat: type a message (Ctrl-C stops a reply; Ctrl-D or an empty line quits).", file=sys.stderr,
          flush=True)
    just_interrupted = False
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if just_interrupted:
                print(file=sys.stderr)
                return INTERRUPTED
            print(f"\n{QUIT_HINT}", file=sys.stderr, flush=True)
            just_interrupted = True
            continue
        if not line.strip():
            return 0
        just_interrupted = not _reply(session, tokenizer, line)


def _reply(session, tokenizer, text: str) -> bool:
    """Stream one reply and print its speed line; False when Ctrl-C stopped it (the chat is left as before)."""
    from transformers import TextStreamer

    try:
        reply = session.reply(text, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    except KeyboardInterrupt:
        print(f"\n[reply stopped; the chat continues from the previous turn] {QUIT_HINT}", file=sys.stderr,
              flush=True)
        return False
    print(f"[{reply.summary()}]", file=sys.stderr, flush=True)
    return True
