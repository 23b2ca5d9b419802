"""PyTorch runtime plugin for polyparallel."""
