"""``hf-dspark generate`` interactive: Ctrl-C stops a reply and keeps the chat, a second Ctrl-C exits with 130,
Ctrl-D with 0. The loop itself with scripted input, then the real thing through a pseudo-terminal (the terminal
turns the typed Ctrl-C into SIGINT) on a tiny saved target whose forward is slowed so a reply is still running."""

from __future__ import annotations

import json
import os
import platform
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from hf_dspark.cli import chat
from hf_dspark.generation.chat import ChatSession


class ScriptedInput:
    """``input()`` that returns the lines given, raising the exceptions given (KeyboardInterrupt, EOFError)."""

    def __init__(self, *events):
        self.events = list(events)

    def __call__(self, prompt=""):
        event = self.events.pop(0)
        if isinstance(event, type) and issubclass(event, BaseException):
            raise event
        return event


class FakeSession:
    """Replies with the text it was sent; a text of "slow" is stopped by Ctrl-C, as ChatSession would be."""

    def __init__(self):
        self.sent = []

    def reply(self, text, streamer=None):
        if text == "slow":
            raise KeyboardInterrupt
        self.sent.append(text)
        return type("Reply", (), {"summary": lambda self: "1 tokens in 0.01 s (100.0 tok/s)"})()


@pytest.mark.parametrize(("events", "code"), [
    (["hi", EOFError], 0),
    (["hi", ""], 0),
    ([KeyboardInterrupt, KeyboardInterrupt], 130),
    (["slow", KeyboardInterrupt], 130),  # Ctrl-C stops the reply, a second one at the prompt exits
    ([KeyboardInterrupt, "hi", KeyboardInterrupt, EOFError], 0),  # a message in between resets the count
])
def test_chat_loop_exit_codes(monkeypatch, capsys, events, code):
    monkeypatch.setattr("builtins.input", ScriptedInput(*events))
    session = FakeSession()
    assert chat.run_chat(session, tokenizer=None) == code
    assert "Traceback" not in capsys.readouterr().err


def test_stopped_reply_returns_to_the_prompt(monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", ScriptedInput("first", "slow", "after", EOFError))
    monkeypatch.setattr("transformers.TextStreamer", lambda *a, **k: None)
    session = FakeSession()
    assert chat.run_chat(session, tokenizer=None) == 0
    assert session.sent == ["first", "after"]
    assert "[reply stopped" in capsys.readouterr().err


def test_chat_session_drops_a_reply_that_did_not_complete(tiny_target, tiny_drafter):
    class Tokenizer:  # words "w<i>" <-> token ids, no chat template
        pad_token_id, eos_token_id, chat_template = 0, 2, None

        def __call__(self, text, return_tensors=None, **kwargs):
            import torch

            return {"input_ids": torch.tensor([[int(w[1:]) for w in text.split()]])}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    session = ChatSession(tiny_target, Tokenizer(), tiny_drafter, system_prompt="w3", max_new_tokens=4)
    session.reply("w5 w6")
    before = [dict(m) for m in session.messages]

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    hook = tiny_target.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        session.reply("w7 w8")
    hook.remove()
    assert session.messages == before  # the stopped turn left nothing behind
    assert len(before) == 3 and session.reply("w9").num_tokens == 4


# -------------------------------------------------------------------------------------------------------
# through a pseudo-terminal
# -------------------------------------------------------------------------------------------------------
DRIVER = """
import json, signal, sys, time
# A terminal user's shell starts the chat with SIGINT at its default; a test run started in the background (nohup,
# `cmd &` without job control) ignores SIGINT, and Python keeps an inherited SIG_IGN: ^C would then do nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
from hf_dspark import cli, loading
from hf_dspark.generation import chat

import transformers

sessions, load_target, post_init = [], loading.load_target, chat.ChatSession.__post_init__
replies, streamed, stalled = [0], [0], [False]
reply, on_text = chat.ChatSession.reply, transformers.TextStreamer.on_finalized_text

def keep_session(self):
    post_init(self)
    sessions.append(self)

def count_replies(self, *args, **kwargs):
    replies[0] += 1
    return reply(self, *args, **kwargs)

def count_words(self, text, stream_end=False):
    streamed[0] += len(text.split())
    return on_text(self, text, stream_end=stream_end)

def slow_forward(*_):
    time.sleep(float(sys.argv[2]))
    if replies[0] == 1 and streamed[0] >= 2 and not stalled[0]:  # the first reply has shown two words: hold it
        stalled[0] = True  # until Ctrl-C stops it, so it cannot finish before the keystroke arrives however loaded
        deadline = time.monotonic() + 60  # the machine is (the test fails if no SIGINT comes)
        while time.monotonic() < deadline:
            time.sleep(0.05)

def slow_target(*args, **kwargs):  # slow enough that a reply is still running when Ctrl-C arrives
    model, tokenizer = load_target(*args, **kwargs)
    model.register_forward_pre_hook(slow_forward)
    model.generation_config.eos_token_id = None  # every reply runs to --max-new-tokens
    return model, tokenizer

chat.ChatSession.__post_init__, chat.ChatSession.reply, loading.load_target = keep_session, count_replies, slow_target
transformers.TextStreamer.on_finalized_text = count_words
try:
    code = cli.main(sys.argv[3:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(sessions[0].messages if sessions else None, f)
sys.exit(code)
"""
MAX_NEW_TOKENS = 40
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}  # what /proc/<pid>/syscall starts with while blocked in read()
FORWARD_DELAY_S = 0.05


class Terminal:
    """A child process on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin/stdout/stderr are the terminal
            os.execve(argv[0], argv, env)
        self.output = ""

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def type_at_prompt(self, text: str, timeout: float = 30.0) -> None:
        """Type once the child is blocked reading the terminal. A SIGINT that lands after ``input()`` printed its
        prompt but before its ``read`` began is only acted on when that read returns (CPython checks signals between
        bytecodes and on EINTR), and the terminal discards the typed ^C: typing as soon as the prompt shows races
        the child, and on a loaded machine the child loses."""
        read_syscall = _READ_SYSCALL.get(platform.machine())
        deadline = time.monotonic() + timeout
        while read_syscall is not None and time.monotonic() < deadline:
            try:
                if Path(f"/proc/{self.pid}/syscall").read_text().split(" ", 1)[0] == read_syscall:
                    break
            except OSError:  # no /proc (not Linux): fall back to a pause
                read_syscall = None
                break
            time.sleep(0.02)
        if read_syscall is None:
            time.sleep(1.0)
        self.type(text)

    def expect(self, pattern: str, timeout: float = 120.0, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.compile(pattern).search(self.output, start)
            if match:
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; the terminal shows:\n{self.output}")
            if select.select([self.fd], [], [], min(remaining, 1.0))[0]:
                try:
                    self.output += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child exited and closed the terminal
                    raise AssertionError(f"the process ended before {pattern!r}:\n{self.output}") from None

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.0)[0]:  # a read without output waiting would block: no deadline
                try:
                    self.output += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the process did not exit:\n{self.output}")


@pytest.mark.slow  # ~25 s: a fresh interpreter imports torch and transformers
def test_ctrl_c_in_a_terminal_stops_the_reply_and_keeps_the_chat(tiny_target_dir, tmp_path):
    path, prompt, _ = tiny_target_dir
    messages_file = tmp_path / "messages.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TERM": "dumb",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DSPARK_CACHE": str(tmp_path / "cache")}  # its step-cost profile stays out of the user's cache
    argv = [sys.executable, "-c", DRIVER, str(messages_file), str(FORWARD_DELAY_S), "generate", "--target",
            str(path), "--drafter", str(path / "drafter"), "--max-new-tokens", str(MAX_NEW_TOKENS), "--threads", "1"]
    term = Terminal(argv, env)
    term.expect(r"> ")
    term.type_at_prompt(prompt + "\r")
    echoed = term.expect(re.escape(prompt) + r"\r?\n")
    term.expect(r"w\d+ w\d+", timeout=60, start=echoed.end())  # the reply is streaming (and held there)
    term.type("\x03")  # Ctrl-C, as typed: the terminal sends SIGINT
    stopped = term.expect(r"\[reply stopped", timeout=30)
    term.expect(r"> ", start=stopped.end())
    term.type_at_prompt("w8 w9\r")  # the chat goes on
    done = term.expect(r"tok/s", timeout=120, start=stopped.end())
    term.expect(r"> ", start=done.end())
    term.type_at_prompt("\x03")
    hint = term.expect(r"Ctrl-C again", timeout=30, start=done.end())
    term.expect(r"> ", start=hint.end())
    term.type_at_prompt("\x03")
    assert term.wait() == 130, term.output
    assert "Traceback" not in term.output and "KeyboardInterrupt" not in term.output[hint.end():]
    messages = json.loads(messages_file.read_text())
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "w8 w9"
    assert len(messages[1]["content"].split()) == MAX_NEW_TOKENS  # the completed reply, whole
