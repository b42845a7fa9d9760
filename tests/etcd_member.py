"""One etcd member on loopback for the tests of the highly available
cluster master (Debian's ``etcd-server``), and what the tests ask of etcd:
which master leads, and ending the leader's lease at once."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.cluster import etcd
from kvtier.errors import ConfigError
from kvtier.tools.server import free_port


class Etcd:
    """One etcd member on loopback, its data in ``folder``."""

    def __init__(self, folder: Path) -> None:
        program = shutil.which("etcd")
        if program is None:
            pytest.fail("etcd is not on PATH: the highly available master needs it "
                        "(apt-get install etcd-server; .ci/run installs it)")
        client, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{client}"
        self.log = folder / "etcd.log"
        # Its data in memory: etcd fsyncs its log on every write, and a slow
        # disk (CI) must not make the masters' elections or reads time out.
        self.data = tempfile.mkdtemp(prefix="kvtier-test-etcd-", dir="/dev/shm")
        self.cmd = [program, "--name", "kvtier-test", "--data-dir", self.data,
                    "--listen-client-urls", f"http://{self.endpoint}",
                    "--advertise-client-urls", f"http://{self.endpoint}",
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", f"kvtier-test=http://127.0.0.1:{peer}"]
        self.start()

    def start(self) -> None:
        """Start the member (again, on its data and ports, after :meth:`kill`)."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            etcd.require(self.endpoint, timeout_s=20)
        except ConfigError:
            self.close()
            raise

    def kill(self) -> None:
        """kill -9 of the member; its data stays for :meth:`start`."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.data, ignore_errors=True)


def _etcd_post(endpoint: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{endpoint}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def leader_now(endpoint: str) -> str | None:
    """The leading master etcd names, None while none does or etcd is slow to answer."""
    try:
        return etcd.leader(endpoint, timeout_s=10)
    except ConfigError:
        return None


def leader_lease(endpoint: str) -> str:
    """The id of the etcd lease the leading master holds its key under."""
    key = base64.b64encode(etcd.leader_key().encode()).decode()
    kvs = _etcd_post(endpoint, "/v3/kv/range", {"key": key}).get("kvs") or []
    assert kvs and kvs[0].get("lease"), kvs
    return kvs[0]["lease"]


def end_lease(endpoint: str, lease: str) -> None:
    """Revoke ``lease`` in etcd, as its running out does: the keys under it
    go (the standbys watching the leader's key campaign). A lease that ran
    out already is left as it is."""
    try:
        _etcd_post(endpoint, "/v3/lease/revoke", {"ID": lease})
    except urllib.error.HTTPError:
        pass  # not found: it ran out meanwhile
