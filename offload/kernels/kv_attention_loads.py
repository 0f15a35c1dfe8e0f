"""The loads of `kv_attention`'s split kernel (Triton helpers, inlined into it): a
step's keys and values from a compressed cache's token groups, dequantized in
registers into even and odd planes (`dequant.py`), the tail's in the compute dtype, and
the additive bias of a step's slots.

Only defined where Triton is installed.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch a kernel
    triton = None
else:
    from offload.kernels.dequant import dequant_bytes, dequant_nibbles


if triton is not None:

    @triton.jit
    def planes(
        codes, scale, minimum, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, dtype: tl.constexpr,
        ROWS: tl.constexpr, COLUMNS: tl.constexpr, BYTES: tl.constexpr,
    ):  # fmt: skip
        """Codes [ROWS, COLUMNS, BYTES] (uint8) to the values of their even and odd codes
        along the last axis, each [ROWS, COLUMNS, codes / 2] (int4: a byte holds two
        codes, the low nibble first)."""
        if BITS == 4:
            even, odd = dequant_nibbles(codes, scale, minimum, SYMMETRIC, dtype, False)
        else:
            even, odd = tl.split(tl.reshape(codes, (ROWS, COLUMNS, BYTES // 2, 2)))
            even = dequant_bytes(even, scale, minimum, SYMMETRIC, dtype, False)
            odd = dequant_bytes(odd, scale, minimum, SYMMETRIC, dtype, False)
        return even, odd

    @triton.jit
    def load_keys(
        kc_ptr, ks_ptr, km_ptr, group_row, j, last,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
        SYMMETRIC: tl.constexpr, TILE_GROUPS: tl.constexpr, dtype: tl.constexpr,
    ):  # fmt: skip
        """Keys of groups j .. j + TILE_GROUPS - 1 (cache groups group_row ..), those
        from last on masked: even and odd tokens [TILE_GROUPS x GROUP / 2, D]."""
        n = tl.arange(0, TILE_GROUPS)
        d = tl.arange(0, BLOCK_D)
        ok = (j + n < last)[:, None] & (d < HEAD_DIM)[None, :]
        # channel d of token t is byte d * k_bytes + t * BITS / 8 of its group
        params = (group_row + n[:, None]) * HEAD_DIM + d[None, :]
        scale = tl.load(ks_ptr + params, mask=ok, other=0.0)[:, :, None]
        minimum = tl.load(km_ptr + params, mask=ok, other=0.0)[:, :, None]
        k_bytes: tl.constexpr = GROUP * BITS // 8
        codes = tl.load(
            kc_ptr + params[:, :, None] * k_bytes + tl.arange(0, k_bytes)[None, None, :],
            mask=ok[:, :, None],
            other=0,
        )
        k_e, k_o = planes(
            codes, scale, minimum, BITS, SYMMETRIC, dtype, TILE_GROUPS, BLOCK_D, k_bytes
        )
        tokens: tl.constexpr = TILE_GROUPS * GROUP // 2
        return (
            tl.reshape(tl.permute(k_e, (0, 2, 1)), (tokens, BLOCK_D)),
            tl.reshape(tl.permute(k_o, (0, 2, 1)), (tokens, BLOCK_D)),
        )

    @triton.jit
    def load_values(
        vc_ptr, vs_ptr, vm_ptr, slots, ok, TOKENS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr,
        SYMMETRIC: tl.constexpr, dtype: tl.constexpr,
    ):  # fmt: skip
        """Values of cache rows slots (even tokens) and slots + 1 (odd), by token and
        channel parity, transposed for the product: v_<token><channel> [D / 2, T]."""
        v_groups: tl.constexpr = HEAD_DIM // VGROUP
        BLOCK_G: tl.constexpr = BLOCK_D // VGROUP
        g = tl.arange(0, BLOCK_G)
        mask = ok[:, None] & (g < v_groups)[None, :]
        # a token's scales and minimums, even then odd tokens: [T, G, 2] split
        params = (slots[:, None, None] + tl.arange(0, 2)[None, None, :]) * v_groups
        params += g[None, :, None]
        scale_e, scale_o = tl.split(tl.load(vs_ptr + params, mask=mask[:, :, None], other=0.0))
        min_e, min_o = tl.split(tl.load(vm_ptr + params, mask=mask[:, :, None], other=0.0))
        v_ee, v_eo = value_row_planes(
            vc_ptr, slots, mask, scale_e, min_e, TOKENS, HEAD_DIM, BLOCK_D, VGROUP, BITS, SYMMETRIC,
            dtype,
        )  # fmt: skip
        v_oe, v_oo = value_row_planes(
            vc_ptr, slots + 1, mask, scale_o, min_o, TOKENS, HEAD_DIM, BLOCK_D, VGROUP, BITS,
            SYMMETRIC, dtype,
        )  # fmt: skip
        return v_ee, v_eo, v_oe, v_oo

    @triton.jit
    def value_row_planes(
        vc_ptr, slots, mask, scale, minimum, TOKENS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr,
        SYMMETRIC: tl.constexpr, dtype: tl.constexpr,
    ):  # fmt: skip
        """Cache rows slots [T]: even and odd channels, [D / 2, T] each. A row's bytes
        are read as [value groups, bytes a group], so each group's scale and minimum
        broadcast along the last axis."""
        g_bytes: tl.constexpr = VGROUP * BITS // 8
        g = tl.arange(0, BLOCK_D // VGROUP)
        codes = tl.load(
            vc_ptr
            + slots[:, None, None] * (HEAD_DIM * BITS // 8)
            + (g * g_bytes)[None, :, None]
            + tl.arange(0, g_bytes)[None, None, :],
            mask=mask[:, :, None],
            other=0,
        )
        even, odd = planes(
            codes, scale[:, :, None], minimum[:, :, None], BITS, SYMMETRIC, dtype, TOKENS,
            BLOCK_D // VGROUP, g_bytes,
        )  # fmt: skip
        even = tl.reshape(even, (TOKENS, BLOCK_D // 2))
        odd = tl.reshape(odd, (TOKENS, BLOCK_D // 2))
        return tl.trans(even), tl.trans(odd)

    @triton.jit
    def tail_keys(
        kt_ptr, row, i, d, e_ok, o_ok, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr
    ):  # fmt: skip
        """The tail's keys (compute dtype): even and odd tokens [T, D]."""
        keys = kt_ptr + (row * GROUP + 2 * i[:, None]) * HEAD_DIM + d[None, :]
        d_ok = (d < HEAD_DIM)[None, :]
        k_e = tl.load(keys, mask=e_ok[:, None] & d_ok, other=0.0)
        k_o = tl.load(keys + HEAD_DIM, mask=o_ok[:, None] & d_ok, other=0.0)
        return k_e, k_o

    @triton.jit
    def tail_values(
        vt_ptr, row, t, t_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr
    ):  # fmt: skip
        """The tail's values of tokens t (compute dtype): even and odd channels [D / 2, T],
        from whole rows [T, D / 2, 2] split in registers."""
        c = tl.arange(0, BLOCK_D // 2)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
        values = tl.load(
            vt_ptr + (row * GROUP + t[:, None, None]) * HEAD_DIM + c,
            mask=t_ok[:, None, None] & (c < HEAD_DIM),
            other=0.0,
        )
        v_e, v_o = tl.split(values)
        return tl.trans(v_e), tl.trans(v_o)

    @triton.jit
    def load_bias(
        bias_row, heads, r_ok, bias_sh, bias_ss, slot_e, e_ok, o_ok, BIAS_PER_HEAD: tl.constexpr
    ):  # fmt: skip
        """The bias of slots slot_e (even tokens) and slot_e + 1 (odd) [T, R] (a bias
        shared by the heads: [T, 1]); 0 where not e_ok / o_ok."""
        if BIAS_PER_HEAD:
            columns = bias_row + heads[None, :] * bias_sh
            b_e = tl.load(columns + slot_e[:, None] * bias_ss, mask=e_ok[:, None] & r_ok, other=0.0)
            b_o = tl.load(
                columns + (slot_e + 1)[:, None] * bias_ss, mask=o_ok[:, None] & r_ok, other=0.0
            )
        else:
            b_e = tl.load(bias_row + slot_e * bias_ss, mask=e_ok, other=0.0)[:, None]
            b_o = tl.load(bias_row + (slot_e + 1) * bias_ss, mask=o_ok, other=0.0)[:, None]
        return b_e, b_o
