"""Tools around the cache: test models, workloads, load client, sizing. Nothing imports tools."""
