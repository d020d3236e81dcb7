"""The cluster: workers as hosts in network namespaces, their shaped network, the fault timeline
(docs/cluster.md)."""
