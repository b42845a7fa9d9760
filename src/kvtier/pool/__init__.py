"""The node pool: one meta service per node, shared by the vLLM instances on it."""
