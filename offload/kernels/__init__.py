"""Compression and fused kernels, below everything else (they import nothing outside
`offload.kernels`).

- `formats.py`: the quantized formats (`Compression`, `KV_GROUPS`), no torch needed.
- `quant.py`: group-wise quantization in plain torch, the reference every Triton kernel
  that dequantizes is checked against; the stored form of compressed weights.
- `qmatmul.py`: dequantize-and-multiply (`qlinear`), its tiles chosen by
  `qmatmul_tiles.py`; on Hopper `qmatmul_wgmma.py` (Gluon) takes 1-64 rows of int4;
  `dequant.py`: the Triton dequantization it shares with the decode attention.
- `kv_cache.py`: the compressed KV cache (`QuantKV`), its layout and byte sizes;
  `kv_quantize.py`: quantizing its completed token groups; `kv_attention.py`: decode
  attention over it (its loads in `kv_attention_loads.py`; int4 on sm_80+ in
  `kv_attention_mma.py`, Gluon); `kv_attention_cpu.py`: the same on the CPU.
- `norm.py`: LayerNorm and RMSNorm a row in one kernel, the residual add before them
  fused.
- `cpu_attention.py`: decode attention on the CPU in C (fp16/bf16/fp32 and compressed
  caches; the source is `cpu_attention.c`), built once per machine by `native.py`
  (the system's C compiler, cached; the torch paths where it cannot be built).
- `cpu_expert.py`: a mixture of experts' expert on the CPU; int4 and int8 experts
  through `cpu_expert_native.py` (C, `cpu_expert.c`, built the same way).
- `launch.py`: when kernels run (`use_kernel`) and how they launch (`Launcher`).

Each kernel module holds the format in its docstring, the plain-torch reference, the
launcher and the Triton kernel; Triton is imported behind a guard, so everything
imports (and runs its torch path) without it.
"""
