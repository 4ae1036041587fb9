"""Start ``kvpage serve`` as a subprocess on a free loopback port, and stop it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import httpx

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(folder: str) -> str:
    """A tiny Llama with a character tokenizer and a chat template, saved as an HF folder."""
    from tiny_models import char_tokenizer, tiny_model

    model, tokenizer = tiny_model("llama"), char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def log_path(port: int) -> str:
    """Where ``running_server`` writes the server's stdout and stderr."""
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvpage-serve-{port}.log")


@contextmanager
def running_server(model: Optional[str], *args: str, startup_timeout_s: float = 180.0,
                   command: Optional[Sequence[str]] = None) -> Iterator[str]:
    """Yield the base URL of a live server; always terminates it (SIGINT, then kill).

    ``command`` replaces the default command line (``python -m kvpage serve MODEL --host
    127.0.0.1 --port PORT --log-level warning ARGS``); ``{port}`` in it becomes the port.
    The server's output goes to ``log_path(port)``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "kvpage", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args]
    if command is not None:
        cmd = [part.replace("{port}", str(port)) for part in command]
    log = open(log_path(port), "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(__file__))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in time")
            time.sleep(0.25)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
