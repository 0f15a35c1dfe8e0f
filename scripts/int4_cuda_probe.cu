// The int4 decode matmul outside Triton: a CUDA prototype for scripts/int4_cuda_probe.py
// (compiled at run time through torch's NVRTC binding; not part of the package).
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

struct U4 { u32 v[4]; };

__device__ __forceinline__ U4 ld_stream(const void* p) {
  U4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "l"(p));
  return r;
}
__device__ __forceinline__ U4 ld_cached(const void* p) {
  U4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 ld_u16(const u16* p) {
  unsigned short r;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return (u32)r;
}
__device__ __forceinline__ u32 nib(u32 a) {  // halves: 1024 + nibble (bits 0-3, 16-19)
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(0x000F000Fu), "r"(0x64006400u));
  return r;
}
__device__ __forceinline__ u32 deq(u32 p, u32 s2, u32 m2) {  // (p - 1024) * s + m, one rounding
  u32 r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(p), "r"(0x64006400u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(s2), "r"(m2));
  return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u16 to_half(float f) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

// x's fragments for K step kb: a[m tile][k16 tile][register], rows past M zero. Thread
// (g, c) holds x columns c * 32 ... c * 32 + 31 of the step, permuted to its k slots.
template <int MT>
__device__ __forceinline__ void x_fragments(u32 (&a)[MT][8][4], const u16* const (&xrow)[MT][2],
                                            const bool (&m_ok)[MT][2], int kb) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 r[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        U4 v;
        if (m_ok[i][h]) {
          v = ld_cached(xrow[i][h] + kb * 128 + q * 8);
        } else {
          v.v[0] = v.v[1] = v.v[2] = v.v[3] = 0u;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) r[q * 4 + e] = v.v[e];
      }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        a[i][2 * w][h] = prmt(r[4 * w], r[4 * w + 2], 0x5410);
        a[i][2 * w][2 + h] = prmt(r[4 * w], r[4 * w + 2], 0x7632);
        a[i][2 * w + 1][h] = prmt(r[4 * w + 1], r[4 * w + 3], 0x5410);
        a[i][2 * w + 1][2 + h] = prmt(r[4 * w + 1], r[4 * w + 3], 0x7632);
      }
    }
}

// One K step of a warp: x's fragments, then each block of 8 W rows (its 16 bytes of
// codes and its scale and minimum, each twice in a register) into acc[block][m tile],
// or, for the parts MODE takes out, into sink.
template <int MT, int NB, int MODE>
__device__ __forceinline__ void k_step(float (&acc)[NB][MT][4], const U4 (&codes)[NB],
                                       const u32 (&s2)[NB], const u32 (&m2)[NB],
                                       const u16* const (&xrow)[MT][2], const bool (&m_ok)[MT][2],
                                       int kb, u32& sink) {
  u32 a[MT][8][4];
  if (MODE != 1 && MODE != 3) x_fragments<MT>(a, xrow, m_ok, kb);
  if (MODE == 2) {
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int t = 0; t < 8; ++t) sink ^= a[i][t][0] ^ a[i][t][1] ^ a[i][t][2] ^ a[i][t][3];
  }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    // the scale and minimum once a block, added: XORed in with every word, as a first
    // version did, they cancel, and the compiler dropped their loads
    if (MODE == 1 || MODE == 2) sink += s2[j] ^ m2[j];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 q = codes[j].v[w];
      if (MODE == 1 || MODE == 2) {
        sink ^= q;
      } else if (MODE == 3) {
        sink ^= deq(nib(q), s2[j], m2[j]) ^ deq(nib(q >> 4), s2[j], m2[j])
            ^ deq(nib(q >> 8), s2[j], m2[j]) ^ deq(nib(q >> 12), s2[j], m2[j]);
      } else {
        const u32 p0 = MODE == 4 ? q : deq(nib(q), s2[j], m2[j]);
        const u32 p1 = MODE == 4 ? s2[j] : deq(nib(q >> 4), s2[j], m2[j]);
        const u32 p2 = MODE == 4 ? m2[j] : deq(nib(q >> 8), s2[j], m2[j]);
        const u32 p3 = MODE == 4 ? q : deq(nib(q >> 12), s2[j], m2[j]);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma(acc[j][i], a[i][2 * w], p0, p1);
          mma(acc[j][i], a[i][2 * w + 1], p2, p3);
        }
      }
    }
  }
}

// What both kernels set up: a warp's first W row n0, its blocks' rows in range and
// where this thread reads them (codes; scales and minimums: the thread's own group, or
// with pair_params the step's two groups, 4 aligned bytes), its K steps kb0 .. kb1 - 1,
// x's rows (those past M read row 0 and are zeroed), the accumulators.
template <int MT, int NB>
struct Warp {
  int g, c, n0, kb0, kb1;
  bool n_ok[NB];
  const unsigned char* wrow[NB];
  const u16* srow[NB];
  const u16* mrow[NB];
  const u16* xrow[MT][2];
  bool m_ok[MT][2];
  float acc[NB][MT][4];

  __device__ __forceinline__ Warp(const u16* x, const unsigned char* codes, const u16* scale,
                                  const u16* minimum, int M, int N, int K, int steps_per_split,
                                  bool pair_params) {
    const int lane = threadIdx.x & 31;
    g = lane >> 2;
    c = lane & 3;
    n0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * NB * 8;
    kb0 = blockIdx.y * steps_per_split;
    kb1 = min(kb0 + steps_per_split, K >> 7);
    const int groups = K >> 6;
    const long row_bytes = K >> 1;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      n_ok[j] = n0 + j * 8 < N;
      const int n = n_ok[j] ? n0 + j * 8 + g : n0 + g;  // a block past N reads the first
      const long params = (long)n * groups + (pair_params ? 0 : c >> 1);
      wrow[j] = codes + n * row_bytes + c * 16;
      srow[j] = scale + params;
      mrow[j] = minimum + params;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = i * 16 + g + 8 * h;
        m_ok[i][h] = m < M;
        xrow[i][h] = x + (long)(m_ok[i][h] ? m : 0) * K + c * 32;
      }
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][i][e] = 0.f;
  }

  // The accumulators out: fp16 into out without split-K, else float32 into the split's
  // partials. d0, d1: x row g, W rows 2c and 2c + 1 of the block; d2, d3: x row g + 8.
  // MODE 1-3 computed nothing: sink is stored where it cannot match, to keep it live.
  template <int MODE>
  __device__ __forceinline__ void finish(u32 sink, int M, int N, float* partial, u16* out) const {
    if (MODE != 0 && MODE != 4) {
      if (sink == 0x12345u) partial[threadIdx.x] = 1.f;
      return;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        if (!n_ok[j]) continue;
        const int n = n0 + j * 8 + 2 * c;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = i * 16 + g + 8 * h;
          if (m >= M) continue;
          if (gridDim.y == 1) {
            const u32 pair = (u32)to_half(acc[j][i][2 * h]) | ((u32)to_half(acc[j][i][2 * h + 1]) << 16);
            *(u32*)(out + (long)m * N + n) = pair;
          } else {
            float* p = partial + ((long)blockIdx.y * M + m) * N + n;
            asm volatile("st.global.v2.f32 [%0], {%1, %2};"
                :: "l"(p), "f"(acc[j][i][2 * h]), "f"(acc[j][i][2 * h + 1]) : "memory");
          }
        }
      }
  }
};

// y[M, N] = x[M, K] @ dequantize(W)^T for int4 W, groups of 64, asymmetric: codes
// [N, K / 2] (low nibble first), scale and minimum [N, K / 64] fp16; x fp16.
// A warp takes NB blocks of 8 W rows, a block 4 warps, blockIdx.y a range of K steps
// of 128. Thread (g = lane / 4, c = lane % 4) reads 16 bytes of W row g of each
// block: codes c * 32 ... c * 32 + 31 of the step. They go to the k slots that thread
// c holds in 8 mma.m16n8k16 (2c, 2c + 1, 2c + 8, 2c + 9), x's columns permuted the same
// way (prmt), so neither is stored differently from `QTensor`. DEPTH K steps of W are
// in flight (a register ring). MODE takes parts out to see what bounds the kernel:
// 0 all; 1 the W loads only; 2 the W and x loads; 3 the W loads and the
// dequantization; 4 the loads and the mma on the raw codes (no dequantization).
template <int MT, int NB, int DEPTH, int MODE>
__global__ void __launch_bounds__(128) qmm4(
    const u16* __restrict__ x, const unsigned char* __restrict__ codes,
    const u16* __restrict__ scale, const u16* __restrict__ minimum,
    float* __restrict__ partial, u16* __restrict__ out,
    int M, int N, int K, int steps_per_split)
{
  Warp<MT, NB> wp(x, codes, scale, minimum, M, N, K, steps_per_split, false);
  if (wp.n0 >= N) return;
  const int kb0 = wp.kb0, kb1 = wp.kb1;
  const unsigned char* const(&wrow)[NB] = wp.wrow;
  const u16* const(&srow)[NB] = wp.srow;
  const u16* const(&mrow)[NB] = wp.mrow;
  u32 sink = 0;
  U4 wq[DEPTH][NB];
  u32 sm[DEPTH][NB];  // scale (low half) and minimum (high half)
#pragma unroll
  for (int s = 0; s < DEPTH; ++s) {
    const int kb = min(kb0 + s, kb1 - 1);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      wq[s][j] = ld_stream(wrow[j] + kb * 64);
      sm[s][j] = ld_u16(srow[j] + kb * 2) | (ld_u16(mrow[j] + kb * 2) << 16);
    }
  }
  for (int base = kb0; base < kb1; base += DEPTH) {
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) {
      const int kb = base + s;
      if (kb >= kb1) break;
      U4 cur[NB];
      u32 s2[NB], m2[NB];
      const int next = min(kb + DEPTH, kb1 - 1);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        cur[j] = wq[s][j];
        s2[j] = prmt(sm[s][j], 0, 0x1010);
        m2[j] = prmt(sm[s][j], 0, 0x3232);
        wq[s][j] = ld_stream(wrow[j] + next * 64);
        sm[s][j] = ld_u16(srow[j] + next * 2) | (ld_u16(mrow[j] + next * 2) << 16);
      }
      k_step<MT, NB, MODE>(wp.acc, cur, s2, m2, wp.xrow, wp.m_ok, kb, sink);
    }
  }
  wp.template finish<MODE>(sink, M, N, partial, out);
}

// The same with W's K steps brought through shared memory by cp.async: a ring of
// STAGES steps a warp, STAGES - 1 of them in flight while one is computed. Each thread
// copies its own 16 bytes of codes and 4 of scales and of minimums (the step's two
// groups) and reads back only those, so the ring needs no barrier, only the thread's
// own wait.
template <int MT, int NB, int STAGES, int MODE>
__global__ void __launch_bounds__(128) qmm4s(
    const u16* __restrict__ x, const unsigned char* __restrict__ codes,
    const u16* __restrict__ scale, const u16* __restrict__ minimum,
    float* __restrict__ partial, u16* __restrict__ out,
    int M, int N, int K, int steps_per_split)
{
  __shared__ __align__(16) U4 ring_codes[4][STAGES][NB][32];
  __shared__ __align__(16) u32 ring_params[4][STAGES][NB][2][32];
  Warp<MT, NB> wp(x, codes, scale, minimum, M, N, K, steps_per_split, true);
  if (wp.n0 >= N) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kb0 = wp.kb0, kb1 = wp.kb1;
  const unsigned char* const(&wrow)[NB] = wp.wrow;
  const u16* const(&srow)[NB] = wp.srow;
  const u16* const(&mrow)[NB] = wp.mrow;
  const u32 half_shift = (wp.c >> 1) * 16;  // this thread's group of the step's two
  u32 sink = 0;
  auto issue = [&](int kb, int slot) {
    if (kb < kb1) {
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const u32 dst = (u32)__cvta_generic_to_shared(&ring_codes[warp][slot][j][lane]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(wrow[j] + kb * 64));
        const u32 ds = (u32)__cvta_generic_to_shared(&ring_params[warp][slot][j][0][lane]);
        const u32 dm = (u32)__cvta_generic_to_shared(&ring_params[warp][slot][j][1][lane]);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(ds), "l"(srow[j] + kb * 2));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dm), "l"(mrow[j] + kb * 2));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(kb0 + s, s);
  int slot = 0;
  for (int kb = kb0; kb < kb1; ++kb) {
    issue(kb + STAGES - 1, (slot + STAGES - 1) % STAGES);
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
    U4 cur[NB];
    u32 s2[NB], m2[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      cur[j] = ring_codes[warp][slot][j][lane];
      s2[j] = prmt(ring_params[warp][slot][j][0][lane] >> half_shift, 0, 0x1010);
      m2[j] = prmt(ring_params[warp][slot][j][1][lane] >> half_shift, 0, 0x1010);
    }
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    k_step<MT, NB, MODE>(wp.acc, cur, s2, m2, wp.xrow, wp.m_ok, kb, sink);
  }
  asm volatile("cp.async.wait_all;");
  wp.template finish<MODE>(sink, M, N, partial, out);
}
