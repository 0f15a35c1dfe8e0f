"""Tiered memory and I/O: the GPU, pinned CPU RAM and an NVMe directory."""
