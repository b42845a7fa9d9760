"""etcd, where Mooncake's highly available masters elect their leader.

With ``kvtier.cluster.etcd_endpoints`` set, every ``kvtier meta`` that runs
a master starts it with ``-enable_ha``: the masters race for one key in
etcd, ``mooncake-store/<cluster id>/master_view``, held under a 5 s lease;
the one that holds it serves at the address the key names, the others wait
as standbys (their RPC port closed) and take the key when its lease runs out
(a dead leader: about 10 s, lease then warm-up). Mooncake's clients are set
up with ``etcd://HOST:PORT;HOST:PORT`` instead of a master address: they
read the key, follow it when it changes and mount their segments again on
the new leader. The new leader starts with an empty index (no oplog): what
was in the cluster is a miss until nodes publish it again.

kvtier itself only reads etcd, over its HTTP gateway (etcd 3.4 and later):
to refuse unreachable endpoints with one line naming the key, and to find
the leader's address before Mooncake's client is set up (Mooncake's setup
holds the GIL while it waits, see :mod:`kvtier.cluster.client`). It writes
nothing there.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request

from kvtier.errors import ConfigError

KEY = "kvtier.cluster.etcd_endpoints"
DEFAULT_CLUSTER_ID = "mooncake_cluster"  # Mooncake's default; MC_STORE_CLUSTER_ID changes it


def endpoints(value: str) -> list[str]:
    """``HOST:PORT`` of each endpoint of the key's value (``;`` or ``,``
    between them, ``http://`` dropped)."""
    return [p.strip().removeprefix("http://") for p in value.replace(",", ";").split(";") if p.strip()]


def entry(value: str) -> str:
    """What a Mooncake client is set up with to follow the leader: ``etcd://A;B``."""
    return "etcd://" + ";".join(endpoints(value))


def cluster_id() -> str:
    """The namespace of the leader's key: ``MC_STORE_CLUSTER_ID`` (read by
    Mooncake's clients too), else Mooncake's default."""
    return os.environ.get("MC_STORE_CLUSTER_ID") or DEFAULT_CLUSTER_ID


def leader_key(cid: str | None = None) -> str:
    return f"mooncake-store/{cid or cluster_id()}/master_view"


def _url(endpoint: str, path: str) -> str:
    return f"http://{endpoint}{path}"


def _healthy(endpoint: str, timeout_s: float) -> str | None:
    """None when ``endpoint`` is an etcd that says it is healthy, else why not."""
    try:
        with urllib.request.urlopen(_url(endpoint, "/health"), timeout=timeout_s) as r:
            body = json.loads(r.read(4096) or b"{}")
    except urllib.error.HTTPError as err:
        return f"{endpoint} answered HTTP {err.code} on /health (not etcd?)"
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return f"{endpoint}: {reason}"
    if not isinstance(body, dict) or "health" not in body:
        return f"{endpoint} is not etcd (no health in its /health answer)"
    if str(body.get("health")).lower() != "true":
        return f"{endpoint} says it is not healthy ({body})"
    return None


def require(value: str, timeout_s: float = 3.0, source: str = "") -> list[str]:
    """The endpoints of ``value`` that answer as a healthy etcd; ConfigError
    naming the key when none does within ``timeout_s`` (retried meanwhile:
    etcd may be starting beside kvtier)."""
    eps = endpoints(value)
    if not eps:
        raise ConfigError(KEY, value, "no endpoint given (HOST:PORT;HOST:PORT)", source)
    deadline = time.monotonic() + timeout_s
    while True:
        why: list[str] = []
        ok = []
        for ep in eps:
            w = _healthy(ep, min(1.0, max(0.1, deadline - time.monotonic())))
            if w:
                why.append(w)
            else:
                ok.append(ep)
        if ok:
            return ok
        if time.monotonic() >= deadline:
            raise ConfigError(KEY, value, "no etcd answers there (the highly available Mooncake master needs "
                              "one): " + "; ".join(why), source)
        time.sleep(0.2)


def leader(value: str, timeout_s: float = 1.0) -> str | None:
    """``HOST:PORT`` of the Mooncake master that leads now, None when none
    does (an election under way); ConfigError naming the key when no
    endpoint answers."""
    body = json.dumps({"key": base64.b64encode(leader_key().encode()).decode()}).encode()
    why = []
    for ep in endpoints(value):
        req = urllib.request.Request(_url(ep, "/v3/kv/range"), data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                got = json.loads(r.read(1 << 16))
        except (OSError, ValueError) as err:
            why.append(f"{ep}: {getattr(err, 'reason', err)}")
            continue
        kvs = got.get("kvs") if isinstance(got, dict) else None
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")).decode(errors="replace") or None
    raise ConfigError(KEY, value, "no etcd answers there: " + "; ".join(why))
