"""Compression and fused kernels. `quant.py` holds the group-wise quantization math
(the plain-torch reference every later Triton kernel is checked against)."""
