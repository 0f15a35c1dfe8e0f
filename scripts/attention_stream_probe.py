"""The int4 decode attention with each program an equal run of (row, group) units
(stream-K), beside `kv_attention_mma`'s split kernel, over `bench_kernels`'s attention
shapes (int4-g64 asymmetric, float16), on one GPU.

    PYTHONPATH=.:scripts python scripts/attention_stream_probe.py          # H100, a minute
    PYTHONPATH=.:scripts python scripts/attention_stream_probe.py --compile-only   # no GPU

Why. `kv_attention_mma` gives each program whole groups of one row (a sequence's KV
head), so every program pays its fixed costs (q, the first group's copies arriving,
the float16 tail read after the loop, the partials and the merge) beside a few groups:
at OPT-30B's 8 groups a row that is about 1.5 groups' time (docs/throughput.md), and
12-14 sequences read 61-63% of HBM. Here there is one wave of programs (`PER_SM` an
SM); program p takes units p U / P .. (p + 1) U / P of the U = rows x groups, row by
row, and its ring runs on across rows: the copies of the next row's first group are
issued during the last group of this one. A row's q, tail, partial and merge stay once
a row and program; a row is merged by the last of its programs to arrive, in program
order (deterministic).

Prints us and share of the HBM copy rate (measured first) for the split kernel and
this one, with each one's largest difference from `decode_attention_reference`; JSON
under $OUT (else benchmarks/results). --compile-only: registers, spills and shared
memory of both kernels for sm_90, and the instructions of each one's group loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from functools import partial
from pathlib import Path

import torch

from offload.kernels import kv_attention_mma as mma
from offload.kernels.kv_cache import QuantKV
from offload.kernels.launch import Launcher, arrival_counters, sm_count

gluon, gl = mma.gluon, getattr(mma, "gl", None)
if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # the split kernel's layouts and steps, as this kernel's globals
    from offload.kernels.kv_attention_mma import (
        _D,
        _LOG2E,
        B_OP,
        MMA,
        _channel,
        _group,
        _issue,
        _merge,
        _ring,
        _stage,
        _tail,
    )

    RING = gl.constexpr(2)  # the ring's groups: the one attended, the next arriving


def stream_attention(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int, out: torch.Tensor,
    programs: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`kv_attention_mma.decode_attention_mma`'s call (q [B, H, 1, 128] over slots 0 ..
    end - 1, into out [B, 1, H x 128]) with each of `programs` (None: one wave) an equal
    run of the rows' full groups. Needs at least one full group."""
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    rows, groups = batch * kv_heads, end // mma.GROUP
    assert groups > 0, "the stream kernel needs a full group"
    units = rows * groups
    if programs is None:
        programs = mma.PER_SM * sm_count(q.device)
    programs = min(programs, units)
    # (every program needs a unit: an empty one between a row's first and last would
    # never arrive, and the row would never be merged)
    assert programs > 0, "programs: at least 1"
    # the most programs a row's units meet: its partials' slots
    slots = min(groups, -(-groups * programs // units) + 1)
    part_acc = torch.empty((batch, heads, slots, dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, batch, heads, slots), dtype=torch.float32, device=q.device)
    per_head = bias.shape[1] > 1
    _launch(
        (programs,), 1,
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if per_head else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_min, cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_min, cache.v_tail,
        part_acc, part_ml, part_ml[1], out, arrival_counters("attention-stream", q.device, rows),
        kv_heads, groups, end % mma.GROUP, cache.k_codes.shape[2], cache.v_codes.shape[2],
        units, programs, slots, mma.LOG2E / math.sqrt(dim),
        heads // kv_heads,  # REP
    )  # fmt: skip
    return out


if gluon is not None:

    @gluon.jit(
        do_not_specialize=[
            "bias_sb", "bias_sh", "kv_heads", "full_groups", "tail_len", "num_groups",
            "max_slots", "units", "programs", "slots",
        ]
    )  # fmt: skip
    def _stream_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr, vc_ptr, vs_ptr, vm_ptr, vt_ptr,
        acc_ptr, m_ptr, l_ptr, out_ptr, count_ptr,
        kv_heads, full_groups, tail_len, num_groups, max_slots, units, programs, slots,
        qk_scale,
        REP: gl.constexpr,
    ):  # fmt: skip
        """Program p: units p units / programs .. (p + 1) units / programs (unit u: group
        u % full_groups of row u // full_groups), row by row; at a row's last unit its
        tail too. Each row's part goes to partial slot p - (the row's first program), and
        the row's last program to arrive merges its slots in order."""
        pid = gl.program_id(0)
        u = (pid.to(gl.int64) * units // programs).to(gl.int32)
        stop = ((pid + 1).to(gl.int64) * units // programs).to(gl.int32)
        ring = _ring(RING)
        d = gl.arange(0, _D, layout=gl.SliceLayout(1, B_OP))
        r = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
        n = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        token = 8 * (n % 8) + n // 8  # the scores' row n is token 8 g + nt
        heads8 = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        bias_ok = (heads8 < REP)[None, :] & (n < 64)[:, None]
        # the first unit's copies and bias
        row = u // full_groups
        grp = u - row * full_groups
        _issue(
            _stage(ring, 0),
            kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, row * num_groups + grp,
            row * max_slots + grp * 64, u < stop,
        )  # fmt: skip
        bias = gl.load(
            bias_ptr + (row // kv_heads) * bias_sb
            + ((row % kv_heads) * REP + heads8)[None, :] * bias_sh
            + (grp * 64 + token)[:, None] * bias_ss,
            mask=bias_ok & (u < stop), other=0.0,
        )  # fmt: skip
        k = 0  # the ring's steps so far
        while u < stop:
            row = u // full_groups
            row_end = gl.minimum(stop, (row + 1) * full_groups)
            b = row // kv_heads
            kvh = row % kv_heads
            q = gl.load(
                q_ptr + b * q_sb + (kvh * REP + r)[None, :] * q_sh + d[:, None],
                mask=(r < REP)[None, :] & (d < _D)[:, None],
                other=0.0,
            )
            m_i = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(0, MMA))
            l_i = gl.zeros([8], gl.float32, gl.SliceLayout(0, MMA))
            out = gl.zeros([_D, 8], gl.float32, MMA)
            grp = u - row * full_groups
            for i in range(row_end - u):
                # the next unit's copies and bias: maybe the next row's first group (its
                # row, sequence and KV head stepped on, not divided out)
                more = u + i + 1 < stop
                ngrp = grp + i + 1
                wrap = (ngrp == full_groups).to(gl.int32)
                nrow = row + wrap
                ngrp -= wrap * full_groups
                nkvh = kvh + wrap
                carry = (nkvh == kv_heads).to(gl.int32)
                nkvh -= carry * kv_heads
                _issue(
                    _stage(ring, (k + 1) % RING),
                    kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, nrow * num_groups + ngrp,
                    nrow * max_slots + ngrp * 64, more,
                )  # fmt: skip
                bias_next = gl.load(
                    bias_ptr + (b + carry) * bias_sb + (nkvh * REP + heads8)[None, :] * bias_sh
                    + (ngrp * 64 + token)[:, None] * bias_ss,
                    mask=bias_ok & more, other=0.0,
                )  # fmt: skip
                m_i, l_i, out = _group(
                    _stage(ring, k % RING), q, bias, qk_scale, m_i, l_i, out, RING - 1
                )
                bias = bias_next
                k += 1
            bias_row = bias_ptr + b * bias_sb + (kvh * REP + heads8)[None, :] * bias_sh
            if row_end == (row + 1) * full_groups and tail_len > 0:
                m_i, l_i, out = _tail(
                    q, kt_ptr, vt_ptr, row, tail_len, bias_row + full_groups * 64 * bias_ss,
                    bias_ss, bias_ok, qk_scale, m_i, l_i, out,
                )  # fmt: skip
            # the row's programs: those whose runs meet its units
            first = ((row * full_groups + 1).to(gl.int64) * programs - 1) // units
            last = (((row + 1) * full_groups).to(gl.int64) * programs - 1) // units
            heads = b * kv_heads * REP + kvh * REP
            part = (heads + heads8) * slots + (pid - first).to(gl.int32)
            ok = heads8 < REP
            gl.store(m_ptr + part, m_i / _LOG2E, mask=ok)
            gl.store(l_ptr + part, l_i, mask=ok)
            m = gl.arange(0, _D, layout=gl.SliceLayout(1, MMA))
            c = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
            at = ((heads + c) * slots + (pid - first).to(gl.int32))[None, :] * _D
            gl.store(
                acc_ptr + at + _channel(m)[:, None],
                out,
                mask=(c < REP)[None, :] & (m < _D)[:, None],
            )
            gl.thread_barrier()  # every thread's partial stored before the release below
            count = (last - first + 1).to(gl.int32)
            if gl.atomic_add(count_ptr + row, 1, sem="acq_rel") == count - 1:
                _merge(acc_ptr, m_ptr, l_ptr, out_ptr, heads, slots, count, REP)
                gl.atomic_xchg(count_ptr + row, 0)
            u = row_end
        async_copy.wait_group(0)

    _launch = Launcher(_stream_kernel)


def measure() -> None:
    from bench_kernels import hbm_rate, int4_attention_cases, timed  # this script's folder

    from offload.kernels.kv_attention import decode_attention

    dev = torch.device("cuda")
    hbm = hbm_rate(dev) * 1e9
    rows = []
    for shape, q, cache, bias, read, reference in int4_attention_cases(dev, random_bias=True):
        model, batch, heads, _, dim, ctx, _ = shape
        out = torch.empty(batch, 1, heads * dim, device=dev, dtype=q.dtype)
        half = mma.PER_SM * sm_count(dev) // 2
        variants = {
            "split (kv_attention_mma)": partial(decode_attention, q, cache, bias, ctx, mma=True),
            "stream, one wave": partial(stream_attention, q, cache, bias, ctx, out),
            "stream, half a wave": partial(stream_attention, q, cache, bias, ctx, out, half),
        }
        for name, call in variants.items():
            err = (call().float() - reference.float()).abs().max().item()
            again = call().clone()
            same = bool(torch.equal(again, call()))  # deterministic: merged in order
            seconds = timed(call)
            rows.append(
                {"model": model, "batch": batch, "context": ctx, "variant": name,
                 "us": seconds * 1e6, "hbm_share": read / seconds / hbm,
                 "max_diff_vs_reference": err, "repeats_bit_for_bit": same}
            )  # fmt: skip
            print(
                f"{model:12s} B{batch:3d} S{ctx:5d} {name:26s} {seconds * 1e6:7.1f} us "
                f"{100 * read / seconds / hbm:5.1f}% diff {err:.2g} repeats {same}",
                flush=True,
            )
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    path = out_dir / f"attn_stream_probe_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"hbm_copy_gbps": hbm / 1e9, "rows": rows}, indent=1))
    print(f"wrote {path}")


def compile_only() -> None:
    """The split kernel (at 2, 3 and 4 stages) and this one for sm_90 without a GPU (REP 1
    and 8): registers, spills, shared memory, and the instructions of the loop that
    issues the MMAs."""
    import collections

    import triton
    from int4_gluon_probe import _k_loop, sass_of  # this script's folder
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernels = [(f"split, {s} stages", mma._mma_attention_kernel, {"STAGES": s}) for s in (2, 3, 4)]
    for name, kernel, constexprs in [*kernels, ("stream", _stream_kernel, {})]:
        for rep in (1, 8):
            names = kernel.arg_names
            pointers = {a: "*i32" if a.startswith(("kc", "ks", "km", "vc", "vs", "vm")) else "*fp16"
                        for a in names if a.endswith("_ptr")}  # fmt: skip
            pointers.update(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", count_ptr="*i32")
            signature = {a: pointers.get(a, "i32") for a in names}
            signature.update(
                qk_scale="fp32", REP="constexpr", **dict.fromkeys(constexprs, "constexpr")
            )
            source = GluonASTSource(
                fn=kernel,
                signature=signature,
                constexprs={"REP": rep, **constexprs},
                attrs={(names.index(a),): [["tt.divisibility", 16]] for a in pointers},
            )
            compiled = triton.compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}
            )
            sass, resources = sass_of(compiled)
            loop = _k_loop(sass, "HMMA")
            spills = sum(op.startswith(("LDL", "STL")) for op in loop)
            mix = dict(collections.Counter(op.split(".")[0] for op in loop).most_common(8))
            print(
                f"{name}, REP {rep}: shared {compiled.metadata.shared} B, {resources}; the "
                f"group loop: {len(loop)} instructions, {spills} local loads and stores, {mix}"
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compile-only", action="store_true", help="sm_90 SASS, no GPU")
    if p.parse_args().compile_only:
        compile_only()
    else:
        measure()
