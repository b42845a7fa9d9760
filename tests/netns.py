"""Two "nodes" on one machine, with two addresses: network namespaces joined by a veth pair.

:class:`NodeLink` makes them. As root, where ``ip netns`` works and the
namespaces can be made, each isolated node gets a network namespace of its
own (loopback up), and a veth pair joins the two nodes: 10.211.T.1 and
10.211.T.2, two real addresses on a private link (nothing leaves the
machine). A node left in the machine's own namespace holds its end of the
pair there. Elsewhere, or with ``KVTIER_TEST_LOOPBACK=1`` in the
environment, the nodes take the loopback addresses 127.0.0.2 and 127.0.0.3
and everything runs in the machine's namespace; tests run the same either
way.

A node's processes run in its namespace when started under
:meth:`NodeLink.prefix` (``ip netns exec NS``) or from a thread inside
:meth:`NodeLink.inside` (a child process inherits the namespace of the
thread that started it); clients that talk to a node's 127.0.0.1 or its
address from another node's side enter its namespace the same way.
:meth:`NodeLink.close` deletes the namespaces, and the veth pair goes with
them; namespaces this module made for a test process that no longer runs
are deleted when the next link is made.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

LOOPBACK_ENV = "KVTIER_TEST_LOOPBACK"  # set to 1: the loopback addresses, even as root
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"^kvt-(\d+)-[12]\b")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _ip_quiet(*args: str) -> None:
    """``ip`` where a failure changes nothing (a clean-up)."""
    try:
        subprocess.run(["ip", *args], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pass


def _setns(fd: int) -> None:
    """Move the calling thread (only it) into the network namespace ``fd`` names."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _sweep_stale() -> None:
    """Delete namespaces left by a test process that was killed before its clean-up."""
    try:
        out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for line in out.splitlines():
        m = _NAME.match(line)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip_quiet("netns", "del", line.split()[0])


class NodeLink:
    """Nodes 1 and 2: their addresses, and the namespaces they run in ("" for the machine's own)."""

    def __init__(self, isolate: tuple[bool, bool] = (True, True)) -> None:
        self.addresses = {1: "127.0.0.2", 2: "127.0.0.3"}
        self.namespaces = {1: "", 2: ""}
        if os.environ.get(LOOPBACK_ENV, "") not in ("", "0"):
            self.why = f"{LOOPBACK_ENV} is set"
            return
        if os.geteuid() != 0:
            self.why = "not root"
            return
        _sweep_stale()
        pid, tag = os.getpid(), os.getpid() % 250 + 1
        ends = {n: f"kvt{pid}n{n}" for n in (1, 2)}
        addrs = {n: f"10.211.{tag}.{n}" for n in (1, 2)}
        try:
            for n in (1, 2):
                if isolate[n - 1]:
                    _ip("netns", "add", f"kvt-{pid}-{n}")
                    self.namespaces[n] = f"kvt-{pid}-{n}"  # made: close() deletes it from here on
            # One command makes the pair with each end in its node's namespace,
            # so no end is left behind in the machine's namespace on a failure.
            where = {n: ["netns", self.namespaces[n]] if self.namespaces[n] else [] for n in (1, 2)}
            _ip("link", "add", ends[1], *where[1], "type", "veth", "peer", "name", ends[2], *where[2])
            for n in (1, 2):
                ns = ["-n", self.namespaces[n]] if self.namespaces[n] else []
                _ip(*ns, "addr", "add", f"{addrs[n]}/24", "dev", ends[n])
                _ip(*ns, "link", "set", ends[n], "up")
                if self.namespaces[n]:
                    _ip(*ns, "link", "set", "lo", "up")
                    with self.inside(n):  # entering it works too
                        pass
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", None) or str(e)).strip()
            self.why = f"could not make them: {detail.splitlines()[-1] if detail else repr(e)}"
            self.close()
            return
        self.addresses = addrs
        self.why = ""

    @property
    def isolated(self) -> bool:
        return any(self.namespaces.values())

    def describe(self) -> str:
        """One line: where the nodes run."""
        if self.isolated:
            where = {n: f"in network namespace {self.namespaces[n]}" if self.namespaces[n]
                     else "in the machine's namespace" for n in (1, 2)}
            return ("a veth pair joins the nodes: "
                    + ", ".join(f"node {n} {self.addresses[n]} {where[n]}" for n in (1, 2)))
        return (f"no network namespaces ({self.why}), loopback addresses: "
                + ", ".join(f"node {n} {self.addresses[n]}" for n in (1, 2)))

    def prefix(self, node: int) -> list[str]:
        """What a command runs under to run in ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]] if self.namespaces[node] else []

    @contextmanager
    def inside(self, node: int) -> Iterator[None]:
        """The calling thread in ``node``'s namespace: its sockets, and the processes it starts."""
        ns = self.namespaces[node]
        if not ns:
            yield
            return
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{ns}") as there:
            _setns(there.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        for n in (2, 1):
            if self.namespaces[n]:
                _ip_quiet("netns", "del", self.namespaces[n])
                self.namespaces[n] = ""


def announce(config: pytest.Config, line: str) -> None:
    """Print ``line`` in the test run's output (also under -q and output capture)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)
