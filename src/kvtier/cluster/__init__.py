"""The cluster tier: Mooncake Store under the node pool, shared by every node.

kvtier grows no distributed system of its own: the cross-node index,
placement, transfer, replication and failover are Mooncake Store's. This
room holds the pieces that touch it, all in the meta service's process:

* :mod:`kvtier.cluster.master`: ``mooncake_master`` as a supervised child of
  ``kvtier meta`` on the master node;
* :mod:`kvtier.cluster.client`: :class:`MooncakeTier`, the node's Mooncake
  client, whose values are arena slots with their kvtier header.
* :mod:`kvtier.cluster.etcd`: with ``kvtier.cluster.etcd_endpoints`` set,
  the etcd where Mooncake's highly available masters elect a leader, read
  (never written) to refuse a bad endpoint and to find the leader.

The store never sees Mooncake: its :class:`~kvtier.movers.ClusterMover`
calls a :class:`~kvtier.movers.RemoteTier` (this client) on threads of its
own. Nothing here is imported unless ``kvtier.cluster.enabled`` is set.
"""
