"""Test hosts on one machine: network namespaces joined by a bridge (`add_host`), and an `llmserver node`
process on one of them (`NodeProcess`; the test module that knows its configuration starts it)."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def add_host(index: int, namespace: str, bridge: str, net: str, veth: str = "llms-") -> None:
    """A test host: a network namespace with its veth pair (`veth`h/n + index) on the bridge, at net.(10 + index)."""
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)  # left by a killed run
    outside, inside = f"{veth}h{index}", f"{veth}n{index}"
    ip("netns", "add", namespace)
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", namespace)
    ip("link", "set", outside, "master", bridge)
    ip("link", "set", outside, "up")
    ip("netns", "exec", namespace, "ip", "addr", "add", f"{net}.{10 + index}/24", "dev", inside)
    ip("netns", "exec", namespace, "ip", "link", "set", inside, "up")
    ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")


@dataclass
class NodeProcess:
    """A worker host's `llmserver node`: its log per start, stopped or killed."""

    index: int
    root: Path
    redis_url: str
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.root / f"node{self.index}-{self.starts}.log"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
