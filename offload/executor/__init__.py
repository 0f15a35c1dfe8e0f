"""The prefetching layer-wise executor (zig-zag block schedule over GPU, CPU and disk)."""
