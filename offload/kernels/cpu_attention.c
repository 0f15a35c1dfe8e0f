/* Decode attention on the CPU: one query token a sequence over its cached keys and
   values, each byte read once, all threads. `cpu_attention.py` calls it; `native.py`
   compiles this file (shipped as package data) once per machine.

   One work item is a (sequence, KV head) pair over a range of its tokens; OpenMP spreads
   the items over torch's threads. Each item streams its tokens once, a block at a time
   (64 tokens of a full-precision cache, one token group of a compressed one), all the
   query heads of the KV head (grouped-query) against each block: scores, an online
   softmax (a running maximum and sum), then the values, so every byte of K and V is read
   from DRAM once and reused from L1 by the query heads. Compressed blocks are used as
   stored: key scores are sum_d (q[d] scale[d]) c'[d, t] + sum_d q[d] centre[d] over the
   centred codes c' (`kv_attention_cpu.py` gives the algebra), values likewise with the
   probabilities folded into their per-token scales. The values of a block and the keys
   of the next are prefetched (into L2: prefetcht2 was 1.14x as fast as prefetcht0 and
   1.6x as fast as none, one core, fp16, Llama-2-70B's shape). Long contexts are split
   into ranges of SPLIT_TOKENS (`cpu_attention.py`) merged after, so a sequence's result
   depends on its context length only, never on the batch or the thread count.

   Vectors are one register: VL = 16 floats with AVX-512, else 8 (AVX2; wider generic
   vectors gcc keeps in memory: 16 floats on AVX2 ran 2.7x (fp16) to 5x (int4) slower). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
/* registers of sums a loop keeps (of 32 with AVX-512, 16 with AVX2) */
#define SUM_REGISTERS (VL == 16 ? 16 : 8)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));

/* a shuffle of two vectors by constant lane indices (gcc 11 has only __builtin_shuffle) */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

#define MAX_TILE 8     /* query heads of one KV head a pass over a block */
#define MAX_BLOCK 128  /* tokens a block: a key group, or DENSE_BLOCK */
#define DENSE_BLOCK 64
#define MAX_DIM 256

enum { F32 = 0, F16 = 1, BF16 = 2 };

typedef struct {
    const float *q;     /* [batch, heads, dim], scaled by 1 / sqrt(dim) */
    const float *bias;  /* [batch, 1 | heads, >= end], tokens contiguous */
    int64_t bias_sb, bias_sh;
    float *out;         /* [batch, heads, dim] */
    float *partial;     /* [batch x kv heads x splits, rep, dim + 2] when splits > 1 */
    int64_t batch, heads, kv_heads, dim, end, splits, threads;
    /* full-precision keys and values of tokens dense_from .. end - 1 */
    const void *k, *v;
    int64_t k_sb, k_sh, k_st, v_sb, v_sh, v_st, dtype, dense_from;
    /* compressed groups 0 .. full_groups - 1 (bits 0: none) */
    int64_t bits, group, vgroup, symmetric, full_groups;
    const uint8_t *kc;
    int64_t kc_sb, kc_sh, kc_sg;
    const uint16_t *ks, *km; /* km NULL when symmetric */
    int64_t ks_sb, ks_sh, ks_sg;
    const uint8_t *vc;
    int64_t vc_sb, vc_sh, vc_st;
    const uint16_t *vs, *vm;
    int64_t vs_sb, vs_sh, vs_st;
} Args;

/* ---- loads and conversions ------------------------------------------------------ */

static inline vf splat(float x) {
#if VL == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x, x, x, x, x};
#endif
}

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff, bits;
    float f;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        f = (float)mantissa * 5.9604644775390625e-8f; /* subnormal: mantissa x 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load_half(const uint16_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss(*p);
#else
    return half_bits_to_float(*p);
#endif
}

static inline vf load_f16(const uint16_t *p) {
#if VL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VL; i++) v[i] = half_bits_to_float(p[i]);
    return v;
#endif
}

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline __attribute__((always_inline)) vf load_row(const void *base, int64_t at,
                                                             int dtype) {
    if (dtype == F32) return load_f32((const float *)base + at);
    if (dtype == F16) return load_f16((const uint16_t *)base + at);
    return load_bf16((const uint16_t *)base + at);
}

static inline float hsum(vf v) {
#if VL == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

static inline vf vmax(vf a, vf b) {
    vi less = a < b;
    return (vf)(((vi)a & ~less) | ((vi)b & less));
}

static inline float hmax(vf v) {
#if VL == 16
    return _mm512_reduce_max_ps((__m512)v);
#else
    float top = v[0];
    for (int i = 1; i < VL; i++) top = v[i] > top ? v[i] : top;
    return top;
#endif
}

/* exp(x) for x <= 0 (0 below -87): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor
   series to r^7 (relative error below 6e-9, a tenth of float32's epsilon) */
static inline vf vexp(vf x) {
    const float shifter = 12582912.0f; /* 1.5 x 2^23: adding it rounds to an integer */
    vi under = x < splat(-87.0f);
    x = (vf)((vi)x & ~under);
    vf shifted = x * 1.44269504088896341f + shifter;
    vf n = shifted - shifter;
    vi power = ((vi)shifted - 0x4b400000 + 127) << 23;
    vf r = x - n * 0.693145751953125f; /* ln2's high bits: n x them is exact */
    r = r - n * 1.428606820309417e-6f;
    vf p = splat(1.0f / 5040);
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (vf)((vi)(p * (vf)power) & ~under);
}

/* ---- compressed codes ---------------------------------------------------------- */
/* A unit of codes decodes to vectors of centred codes (code - 2^(bits-1)): INT8, 16
   bytes: 16 values in order. INT4_PAIR, 16 bytes: 32 values, low nibbles (the even
   values) and high nibbles (the odd ones) of each VL bytes in turn. INT4_HALF, 8
   bytes: 16 values, the even ones then the odd ones (one vector with AVX-512). */
enum { INT8 = 0, INT4_PAIR = 1, INT4_HALF = 2 };

static inline int unit_bytes(int kind) { return kind == INT4_HALF ? 8 : 16; }
static inline int unit_values(int kind) { return kind == INT4_PAIR ? 32 : 16; }
static inline int unit_vectors(int kind) { return unit_values(kind) / VL; }

/* VL signed bytes of x (from byte `from`), each shifted right by `shift`
   (arithmetic), as floats */
static inline __attribute__((always_inline)) vf bytes_to_float(i8x16 x, int from, int shift) {
#if VL == 16
    __m512i wide = _mm512_cvtepi8_epi32((__m128i)x);
    if (shift) wide = _mm512_srai_epi32(wide, shift);
    return (vf)_mm512_cvtepi32_ps(wide);
#elif defined(__AVX2__)
    __m128i part = from ? _mm_unpackhi_epi64((__m128i)x, (__m128i)x) : (__m128i)x;
    __m256i wide = _mm256_cvtepi8_epi32(part);
    if (shift) wide = _mm256_srai_epi32(wide, shift);
    return (vf)_mm256_cvtepi32_ps(wide);
#else
    i8x8 part;
    memcpy(&part, (const char *)&x + from, 8);
    return __builtin_convertvector(__builtin_convertvector(part, vi) >> shift, vf);
#endif
}

static inline __attribute__((always_inline)) void decode(int kind, const uint8_t *p, vf *out) {
#if VL == 16
    /* int4 with AVX-512: a byte widened to 32 bits indexes a table of the 16 centred
       values by its low 4 bits (vpermps reads no others), its high nibble after a
       shift: 4 instructions for 32 values where sign extension and conversion take 8 */
    if (kind != INT8) {
        const __m512 centred = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3,
                                              4, 5, 6, 7);
        __m128i bytes;
        if (kind == INT4_PAIR) {
            bytes = _mm_loadu_si128((const __m128i *)p);
        } else { /* the low nibbles of 8 bytes, then (shifted down) their high ones */
            uint64_t w;
            memcpy(&w, p, 8);
            bytes = _mm_set_epi64x((long long)(w >> 4), (long long)w);
        }
        __m512i wide = _mm512_cvtepu8_epi32(bytes);
        out[0] = (vf)_mm512_permutexvar_ps(wide, centred);
        if (kind == INT4_PAIR)
            out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), centred);
        return;
    }
#endif
    i8x16 x;
    if (kind == INT4_HALF) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= 0x8888888888888888ull;
        x = (i8x16)(u64x2){w << 4, w};
    } else {
        memcpy(&x, p, 16);
        /* int8: code - 128 as int8. int4: flipping each nibble's top bit makes it its
           centred value as signed 4 bits; a byte's arithmetic shift right by 4
           sign-extends the high nibble, the same of the byte shifted left by 4 (in
           64-bit lanes) the low nibble */
        x ^= (int8_t)(kind == INT8 ? 0x80 : 0x88);
    }
#if VL == 16
    if (kind == INT8) {
        out[0] = bytes_to_float(x, 0, 0);
    } else if (kind == INT4_PAIR) {
        out[0] = bytes_to_float((i8x16)((u64x2)x << 4), 0, 4);
        out[1] = bytes_to_float(x, 0, 4);
    } else {
        out[0] = bytes_to_float(x, 0, 4);
    }
#else
    if (kind == INT8) {
        out[0] = bytes_to_float(x, 0, 0);
        out[1] = bytes_to_float(x, 8, 0);
    } else if (kind == INT4_PAIR) {
        i8x16 low = (i8x16)((u64x2)x << 4);
        out[0] = bytes_to_float(low, 0, 4);
        out[1] = bytes_to_float(x, 0, 4);
        out[2] = bytes_to_float(low, 8, 4);
        out[3] = bytes_to_float(x, 8, 4);
    } else {
        out[0] = bytes_to_float(x, 0, 4);
        out[1] = bytes_to_float(x, 8, 4);
    }
#endif
}

/* the unit's values in their natural order, from decode's order */
#if VL == 16
#define INTERLEAVE_LOW(a, b) SHUFFLE(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
#define INTERLEAVE_HIGH(a, b) SHUFFLE(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
#else
#define INTERLEAVE_LOW(a, b) SHUFFLE(a, b, 0, 8, 1, 9, 2, 10, 3, 11)
#define INTERLEAVE_HIGH(a, b) SHUFFLE(a, b, 4, 12, 5, 13, 6, 14, 7, 15)
#endif

static inline __attribute__((always_inline)) void natural(int kind, const vf *in, vf *out) {
    if (kind == INT8) {
        for (int v = 0; v < unit_vectors(INT8); v++) out[v] = in[v];
        return;
    }
#if VL == 16
    if (kind == INT4_HALF) {
        out[0] = SHUFFLE(in[0], in[0], 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        return;
    }
#endif
    for (int v = 0; v < unit_vectors(kind); v += 2) {
        out[v] = INTERLEAVE_LOW(in[v], in[v + 1]);
        out[v + 1] = INTERLEAVE_HIGH(in[v], in[v + 1]);
    }
}

/* ---- one work item: a (sequence, KV head) pair over a range of tokens ------------- */

typedef struct {
    const Args *a;
    int64_t row, kv_head, rep, dim;
    const float *q;    /* the pair's rep query heads [rep, dim] */
    float *m, *l;      /* [rep]: running maximum and sum of exp */
    float *acc;        /* [rep, dim]: running sum of p x values, natural channel order */
    float s[MAX_TILE][MAX_BLOCK + 16]; /* a block's scores, then probabilities */
    float alpha[MAX_TILE];             /* a block's rescale of the running sums */
    float qs[MAX_TILE][MAX_DIM];       /* query x key scale of a group */
    float coef[MAX_TILE][MAX_DIM / 16][MAX_BLOCK]; /* p x value scale, by value group */
    float centre[MAX_DIM / 16][MAX_BLOCK];         /* value centres by value group */
    float value_scale[MAX_DIM / 16][MAX_BLOCK];
} Item;

/* bias, then the online softmax of scores s[0 .. tile)[0 .. n) of heads first ..: s
   becomes the probabilities (relative to the new maxima), alpha each head's rescale */
static void softmax_block(Item *it, int64_t first, int tile, int64_t token0, int n) {
    const Args *a = it->a;
    for (int r = 0; r < tile; r++) {
        int64_t head = it->kv_head * it->rep + first + r;
        const float *bias = a->bias + it->row * a->bias_sb + head * a->bias_sh + token0;
        float *s = it->s[r];
        vf top = splat(-INFINITY);
        int t = 0;
        for (; t + VL <= n; t += VL) {
            vf x = load_f32(s + t) + load_f32(bias + t);
            store_f32(s + t, x);
            top = vmax(top, x);
        }
        float block_max = hmax(top);
        for (; t < n; t++) {
            s[t] += bias[t];
            block_max = s[t] > block_max ? s[t] : block_max;
        }
        for (; t < ((n + 15) & ~15); t++) s[t] = -INFINITY;
        float old_max = it->m[first + r];
        float new_max = block_max > old_max ? block_max : old_max;
        if (new_max == -INFINITY) { /* nothing unmasked yet */
            it->alpha[r] = 1.0f;
            for (int t = 0; t < n; t++) s[t] = 0.0f;
            continue;
        }
        it->alpha[r] = expf(old_max - new_max);
        it->m[first + r] = new_max;
        vf total = splat(0.0f);
        for (int t = 0; t < n; t += VL) {
            vf p = vexp(load_f32(s + t) - new_max);
            store_f32(s + t, p);
            total += p;
        }
        it->l[first + r] = it->l[first + r] * it->alpha[r] + hsum(total);
    }
}

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)p + at, 0, 1);
}

/* lane i: the sum of v[i]'s lanes (i < VL), by a transpose and add (45 operations for
   16 sums): pairs of vectors interleaved within 128-bit lanes by 32 then 64 bits, then
   the 128-bit lanes (then the 256-bit halves) of pairs */
#if VL == 16
#define LANES_32(a, b, o) SHUFFLE(a, b, 0 + o, 16 + o, 1 + o, 17 + o, 4 + o, 20 + o, 5 + o, \
                                  21 + o, 8 + o, 24 + o, 9 + o, 25 + o, 12 + o, 28 + o,   \
                                  13 + o, 29 + o)
#define LANES_64(a, b, o) SHUFFLE(a, b, 0 + o, 1 + o, 16 + o, 17 + o, 4 + o, 5 + o, 20 + o, \
                                  21 + o, 8 + o, 9 + o, 24 + o, 25 + o, 12 + o, 13 + o,   \
                                  28 + o, 29 + o)
#define LANES_128(a, b, o) SHUFFLE(a, b, 0 + o, 1 + o, 2 + o, 3 + o, 8 + o, 9 + o, 10 + o, \
                                   11 + o, 16 + o, 17 + o, 18 + o, 19 + o, 24 + o, 25 + o, \
                                   26 + o, 27 + o)
#else
#define LANES_32(a, b, o) SHUFFLE(a, b, 0 + o, 8 + o, 1 + o, 9 + o, 4 + o, 12 + o, 5 + o, 13 + o)
#define LANES_64(a, b, o) SHUFFLE(a, b, 0 + o, 1 + o, 8 + o, 9 + o, 4 + o, 5 + o, 12 + o, 13 + o)
#define LANES_128(a, b, o) SHUFFLE(a, b, 0 + o, 1 + o, 2 + o, 3 + o, 8 + o, 9 + o, 10 + o, 11 + o)
#endif

static inline vf sum_lanes(const vf *v) {
    vf a[VL / 2], b[VL / 4];
    for (int i = 0; i < VL / 2; i++)
        a[i] = LANES_32(v[2 * i], v[2 * i + 1], 0) + LANES_32(v[2 * i], v[2 * i + 1], 2);
    for (int i = 0; i < VL / 4; i++)
        b[i] = LANES_64(a[2 * i], a[2 * i + 1], 0) + LANES_64(a[2 * i], a[2 * i + 1], 2);
#if VL == 16
    vf c[2];
    for (int i = 0; i < 2; i++)
        c[i] = LANES_128(b[2 * i], b[2 * i + 1], 0) + LANES_128(b[2 * i], b[2 * i + 1], 4);
    return LANES_128(c[0], c[1], 0) + LANES_128(c[0], c[1], 4);
#else
    return LANES_128(b[0], b[1], 0) + LANES_128(b[0], b[1], 4);
#endif
}

/* scores of full-precision keys of tokens token0 .. token0 + n - 1, VL tokens at a
   time: a vector of partial dot products a token and head, then sum_lanes; the values of
   the same tokens are prefetched meanwhile */
static inline __attribute__((always_inline)) void dense_scores(Item *it, int64_t first,
                                                               int tile, int64_t token0,
                                                               int n, int dtype) {
    const Args *a = it->a;
    const int vectors = it->dim / VL, size = dtype == F32 ? 4 : 2;
    const int64_t base = it->row * a->k_sb + it->kv_head * a->k_sh;
    const int64_t value_base = it->row * a->v_sb + it->kv_head * a->v_sh;
    const float *q = it->q + first * it->dim;
    for (int t16 = 0; t16 < n; t16 += VL) {
        vf dots[MAX_TILE][VL];
        for (int t = 0; t < VL; t += 2) { /* two tokens: each query vector loaded once */
            if (t16 + t >= n) {
                for (int r = 0; r < tile; r++) dots[r][t] = dots[r][t + 1] = splat(0.0f);
                continue;
            }
            const int second = t16 + t + 1 < n;
            int64_t token = token0 + t16 + t - a->dense_from;
            if (first == 0)
                for (int i = 0; i <= second; i++)
                    prefetch_row((const char *)a->v + (value_base + (token + i) * a->v_st) * size,
                                 it->dim * size);
            int64_t at = base + token * a->k_st, next = second ? at + a->k_st : at;
            vf sum0[MAX_TILE], sum1[MAX_TILE];
            for (int r = 0; r < tile; r++) sum0[r] = sum1[r] = splat(0.0f);
            for (int j = 0; j < vectors; j++) {
                vf key0 = load_row(a->k, at + VL * j, dtype);
                vf key1 = load_row(a->k, next + VL * j, dtype);
                for (int r = 0; r < tile; r++) {
                    vf query = load_f32(q + r * it->dim + VL * j);
                    sum0[r] += query * key0;
                    sum1[r] += query * key1;
                }
            }
            for (int r = 0; r < tile; r++) dots[r][t] = sum0[r], dots[r][t + 1] = sum1[r];
        }
        for (int r = 0; r < tile; r++) store_f32(it->s[r] + t16, sum_lanes(dots[r]));
    }
}

/* acc = acc x alpha + p . values for full-precision values of tokens token0 ..; the
   keys of the next block are prefetched meanwhile */
static inline __attribute__((always_inline)) void dense_values(Item *it, int64_t first,
                                                               int tile, int64_t token0,
                                                               int n, int dtype) {
    const Args *a = it->a;
    const int vectors = it->dim / VL, size = dtype == F32 ? 4 : 2;
    const int columns = SUM_REGISTERS / tile; /* vectors of channels a pass, in registers */
    const int64_t base = it->row * a->v_sb + it->kv_head * a->v_sh;
    const int64_t key_base = it->row * a->k_sb + it->kv_head * a->k_sh;
    for (int j = 0; j < vectors; j += columns) {
        vf sum[MAX_TILE][SUM_REGISTERS];
        for (int r = 0; r < tile; r++)
            for (int c = 0; c < columns; c++) sum[r][c] = splat(0.0f);
        for (int t = 0; t < n; t++) {
            int64_t token = token0 + t - a->dense_from;
            if (j == 0 && first == 0 && token0 + n + t < a->end)
                prefetch_row((const char *)a->k + (key_base + (token + n) * a->k_st) * size,
                             it->dim * size);
            int64_t at = base + token * a->v_st + VL * j;
            for (int c = 0; c < columns; c++) {
                if (j + c >= vectors) break;
                vf value = load_row(a->v, at + VL * c, dtype);
                for (int r = 0; r < tile; r++) sum[r][c] += it->s[r][t] * value;
            }
        }
        for (int r = 0; r < tile; r++) {
            float *acc = it->acc + (first + r) * it->dim + VL * j;
            for (int c = 0; c < columns; c++) {
                if (j + c >= vectors) break;
                store_f32(acc + VL * c, load_f32(acc + VL * c) * it->alpha[r] + sum[r][c]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void dense_block(Item *it, int64_t first,
                                                              int tile, int64_t token0, int n,
                                                              int dtype) {
    dense_scores(it, first, tile, token0, n, dtype);
    softmax_block(it, first, tile, token0, n);
    dense_values(it, first, tile, token0, n, dtype);
}

/* channels a key dot product sums in one float32 chain; the chains are summed after */
#ifndef CHAIN
#define CHAIN 16
#endif

/* key scores of compressed group g: sum over channels of (q x scale) x centred code,
   plus q . centre. Keys are stored per channel, a group's tokens along a row: a unit of
   each row at a time (16 or 32 tokens), its vectors of scores in registers. The
   group's values and the next group's keys are prefetched meanwhile. */
static inline __attribute__((always_inline)) void quant_scores(Item *it, int64_t first,
                                                               int tile, int64_t g, int kind) {
    const Args *a = it->a;
    const int dim = it->dim, group = a->group;
    const int row_bytes = group * a->bits / 8, ub = unit_bytes(kind), uv = unit_vectors(kind);
    const int units = row_bytes / ub;
    const int64_t at = it->row * a->ks_sb + it->kv_head * a->ks_sh + g * a->ks_sg;
    const uint16_t *scale = a->ks + at, *minimum = a->km ? a->km + at : 0;
    const float half = (float)(1 << (a->bits - 1));
    const float zero_shift = half - (float)(((1 << a->bits) - 1) / 2); /* symmetric */
    float bias_of_centre[MAX_TILE];
    for (int r = 0; r < tile; r++) {
        vf dot = splat(0.0f);
        for (int d = 0; d < dim; d += VL) {
            vf sc = load_f16(scale + d);
            vf centre = minimum ? load_f16(minimum + d) + sc * half : sc * zero_shift;
            vf q = load_f32(it->q + (first + r) * dim + d);
            store_f32(it->qs[r] + d, q * sc);
            dot += q * centre;
        }
        bias_of_centre[r] = hsum(dot);
    }
    const int64_t pair = it->row * a->kc_sb + it->kv_head * a->kc_sh;
    const uint8_t *codes = a->kc + pair + g * a->kc_sg;
    const uint8_t *next = g + 1 < a->full_groups ? codes + a->kc_sg : 0;
    const uint8_t *values = a->vc + it->row * a->vc_sb + it->kv_head * a->vc_sh;
    const int64_t value_bytes = dim * a->bits / 8, group_lines = (int64_t)dim * row_bytes / 64;
    for (int u = 0; u < units; u++) {
        vf total[MAX_TILE][4];
        for (int r = 0; r < tile; r++)
            for (int v = 0; v < uv; v++) total[r][v] = splat(0.0f);
        for (int d0 = 0; d0 < dim; d0 += CHAIN) {
            vf part[MAX_TILE][4];
            for (int r = 0; r < tile; r++)
                for (int v = 0; v < uv; v++) part[r][v] = splat(0.0f);
            for (int d = d0; d < d0 + CHAIN && d < dim; d++) {
                if (u == 0 && first == 0) { /* a line of each, a channel */
                    if (d < group)
                        prefetch_row(values + (g * group + d) * a->vc_st, value_bytes);
                    if (next && d < group_lines) __builtin_prefetch(next + 64 * d, 0, 1);
                }
                vf c[4];
                decode(kind, codes + (int64_t)d * row_bytes + u * ub, c);
                for (int r = 0; r < tile; r++) {
                    vf q = splat(it->qs[r][d]);
                    for (int v = 0; v < uv; v++) part[r][v] += q * c[v];
                }
            }
            for (int r = 0; r < tile; r++)
                for (int v = 0; v < uv; v++) total[r][v] += part[r][v];
        }
        for (int r = 0; r < tile; r++) {
            vf ordered[4];
            natural(kind, total[r], ordered);
            for (int v = 0; v < uv; v++)
                store_f32(it->s[r] + (u * uv + v) * VL, ordered[v] + bias_of_centre[r]);
        }
    }
}

/* acc = acc x alpha + p . values of compressed group g: values are stored per token,
   scaled per value group of channels: sum over tokens of (p x scale) x centred code,
   plus p . centre */
static inline __attribute__((always_inline)) void quant_values(Item *it, int64_t first,
                                                               int tile, int64_t g, int kind) {
    const Args *a = it->a;
    const int dim = it->dim, group = a->group, groups = dim / a->vgroup;
    const int row_bytes = dim * a->bits / 8, ub = unit_bytes(kind), uv = unit_vectors(kind);
    const int units = row_bytes / ub, values = VL * uv;
    const float half = (float)(1 << (a->bits - 1));
    const float zero_shift = half - (float)(((1 << a->bits) - 1) / 2);
    const int64_t token0 = g * group;
    const int64_t at = it->row * a->vs_sb + it->kv_head * a->vs_sh;
    if (first == 0) {
        for (int t = 0; t < group; t++) {
            const uint16_t *scale = a->vs + at + (token0 + t) * a->vs_st;
            const uint16_t *minimum = a->vm ? a->vm + at + (token0 + t) * a->vs_st : 0;
            for (int j = 0; j < groups; j++) {
                float sc = load_half(scale + j);
                it->value_scale[j][t] = sc;
                it->centre[j][t] = minimum ? load_half(minimum + j) + sc * half : sc * zero_shift;
            }
        }
    }
    float centre_sum[MAX_TILE][MAX_DIM / 16];
    for (int r = 0; r < tile; r++) {
        for (int j = 0; j < groups; j++) {
            vf dot = splat(0.0f);
            for (int t = 0; t < group; t += VL) {
                vf p = load_f32(it->s[r] + t);
                store_f32(it->coef[r][j] + t, p * load_f32(it->value_scale[j] + t));
                dot += p * load_f32(it->centre[j] + t);
            }
            centre_sum[r][j] = hsum(dot);
        }
    }
    const uint8_t *codes = a->vc + it->row * a->vc_sb + it->kv_head * a->vc_sh;
    for (int u = 0; u < units; u++) {
        const int j = u * values / a->vgroup;
        vf sum[MAX_TILE][4];
        for (int r = 0; r < tile; r++)
            for (int v = 0; v < uv; v++) sum[r][v] = splat(0.0f);
        for (int t = 0; t < group; t++) {
            vf c[4];
            decode(kind, codes + (token0 + t) * a->vc_st + u * ub, c);
            for (int r = 0; r < tile; r++) {
                vf p = splat(it->coef[r][j][t]);
                for (int v = 0; v < uv; v++) sum[r][v] += p * c[v];
            }
        }
        for (int r = 0; r < tile; r++) {
            vf ordered[4];
            natural(kind, sum[r], ordered);
            float *acc = it->acc + (first + r) * dim + u * values;
            for (int v = 0; v < uv; v++)
                store_f32(acc + VL * v, load_f32(acc + VL * v) * it->alpha[r] + ordered[v] +
                                            centre_sum[r][j]);
        }
    }
}

/* the largest power-of-two head tile of at most `limit` and `left` heads */
static inline int tile_of(int left, int limit) {
    int tile = 1;
    while (tile * 2 <= left && tile * 2 <= limit) tile *= 2;
    return tile;
}

static inline __attribute__((always_inline)) void quant_tile(Item *it, int64_t first, int tile,
                                                             int64_t g, int kkind, int vkind) {
    quant_scores(it, first, tile, g, kkind);
    softmax_block(it, first, tile, g * it->a->group, it->a->group);
    quant_values(it, first, tile, g, vkind);
}

static inline __attribute__((always_inline)) void quant_group(Item *it, int64_t g, int kkind,
                                                              int vkind) {
    const int widest = unit_vectors(kkind) > unit_vectors(vkind) ? unit_vectors(kkind)
                                                                  : unit_vectors(vkind);
    for (int64_t first = 0; first < it->rep;) {
        int tile = tile_of(it->rep - first, SUM_REGISTERS / widest);
        switch (tile) {
        case 8: quant_tile(it, first, 8, g, kkind, vkind); break;
        case 4: quant_tile(it, first, 4, g, kkind, vkind); break;
        case 2: quant_tile(it, first, 2, g, kkind, vkind); break;
        default: quant_tile(it, first, 1, g, kkind, vkind);
        }
        first += tile;
    }
}

static inline __attribute__((always_inline)) void dense_tiles(Item *it, int64_t t, int n,
                                                              int dtype) {
    for (int64_t first = 0; first < it->rep;) {
        int tile = tile_of(it->rep - first, SUM_REGISTERS / 2); /* two tokens' sums a head */
        switch (tile) {
        case 8: dense_block(it, first, 8, t, n, dtype); break;
        case 4: dense_block(it, first, 4, t, n, dtype); break;
        case 2: dense_block(it, first, 2, t, n, dtype); break;
        default: dense_block(it, first, 1, t, n, dtype);
        }
        first += tile;
    }
}

static void dense_range(Item *it, int64_t token0, int64_t token1) {
    const int dtype = (int)it->a->dtype;
    for (int64_t t = token0; t < token1; t += DENSE_BLOCK) {
        int n = token1 - t < DENSE_BLOCK ? (int)(token1 - t) : DENSE_BLOCK;
        if (dtype == F16)
            dense_tiles(it, t, n, F16);
        else if (dtype == BF16)
            dense_tiles(it, t, n, BF16);
        else
            dense_tiles(it, t, n, F32);
    }
}

static int key_kind(const Args *a) {
    if (a->bits == 8) return INT8;
    return a->group >= 32 ? INT4_PAIR : INT4_HALF;
}

static int value_kind(const Args *a) {
    if (a->bits == 8) return INT8;
    return a->vgroup >= 32 && a->dim % 32 == 0 ? INT4_PAIR : INT4_HALF;
}

static void quant_range(Item *it, int64_t g0, int64_t g1) {
    const int kk = key_kind(it->a), vk = value_kind(it->a);
    for (int64_t g = g0; g < g1; g++) {
        if (kk == INT8)
            quant_group(it, g, INT8, INT8);
        else if (kk == INT4_PAIR && vk == INT4_PAIR)
            quant_group(it, g, INT4_PAIR, INT4_PAIR);
        else if (kk == INT4_PAIR)
            quant_group(it, g, INT4_PAIR, INT4_HALF);
        else
            quant_group(it, g, INT4_HALF, INT4_HALF);
    }
}

static void run_item(const Args *a, int64_t item) {
    const int64_t pair = item / a->splits, split = item % a->splits;
    const int64_t rep = a->heads / a->kv_heads, dim = a->dim;
    Item it;
    it.a = a;
    it.row = pair / a->kv_heads;
    it.kv_head = pair % a->kv_heads;
    it.rep = rep;
    it.dim = dim;
    it.q = a->q + (it.row * a->heads + it.kv_head * rep) * dim;
    float m[64], l[64], *acc;
    float *out = a->partial ? a->partial + item * rep * (dim + 2) : 0;
    acc = out ? out + 2 * rep : a->out + (it.row * a->heads + it.kv_head * rep) * dim;
    it.m = out ? out : m;
    it.l = out ? out + rep : l;
    it.acc = acc;
    for (int64_t r = 0; r < rep; r++) it.m[r] = -INFINITY, it.l[r] = 0.0f;
    memset(acc, 0, rep * dim * sizeof(float));
    /* splits divide the compressed groups (the full-precision tail joins the last) or
       the dense cache's blocks */
    if (a->bits) {
        int64_t g0 = a->full_groups * split / a->splits;
        int64_t g1 = a->full_groups * (split + 1) / a->splits;
        quant_range(&it, g0, g1);
        if (split == a->splits - 1) dense_range(&it, a->dense_from, a->end);
    } else {
        int64_t blocks = (a->end + DENSE_BLOCK - 1) / DENSE_BLOCK;
        int64_t t0 = blocks * split / a->splits * DENSE_BLOCK;
        int64_t t1 = blocks * (split + 1) / a->splits * DENSE_BLOCK;
        dense_range(&it, t0, t1 < a->end ? t1 : a->end);
    }
    if (!out) {
        for (int64_t r = 0; r < rep; r++) {
            float scale = it.l[r] > 0 ? 1.0f / it.l[r] : 0.0f;
            for (int64_t d = 0; d < dim; d++) acc[r * dim + d] *= scale;
        }
    }
}

/* out[b, h] from the splits' partial maxima, sums and accumulators */
static void merge(const Args *a, int64_t pair_head) {
    const int64_t rep = a->heads / a->kv_heads, dim = a->dim;
    const int64_t pair = pair_head / rep, r = pair_head % rep;
    const int64_t stride = rep * (dim + 2);
    const float *first = a->partial + pair * a->splits * stride;
    float top = -INFINITY, total = 0.0f;
    for (int64_t s = 0; s < a->splits; s++) {
        float m = first[s * stride + r];
        top = m > top ? m : top;
    }
    float *out = a->out + (pair * rep + r) * dim;
    memset(out, 0, dim * sizeof(float));
    if (top == -INFINITY) return;
    for (int64_t s = 0; s < a->splits; s++) {
        const float *part = first + s * stride;
        float weight = expf(part[r] - top);
        total += weight * part[rep + r];
        for (int64_t d = 0; d < dim; d++) out[d] += weight * part[2 * rep + r * dim + d];
    }
    for (int64_t d = 0; d < dim; d++) out[d] /= total;
}

int attend(const Args *a) {
    if (a->dim % 16 || a->dim > MAX_DIM || a->heads % a->kv_heads || a->heads / a->kv_heads > 64)
        return 1;
    const int64_t items = a->batch * a->kv_heads * a->splits;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->threads)
    for (int64_t item = 0; item < items; item++) run_item(a, item);
    if (a->splits > 1) {
        const int64_t heads = a->batch * a->heads;
#pragma omp parallel for schedule(static) num_threads(a->threads)
        for (int64_t h = 0; h < heads; h++) merge(a, h);
    }
    return 0;
}

/* reads nbytes (a multiple of 64) with all threads; returns a sum so it is not elided */
double read_bytes(const float *p, int64_t nbytes, int64_t threads) {
    const int64_t lines = nbytes / 64;
    double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
    for (int64_t chunk = 0; chunk < lines; chunk += 1024) {
        int64_t last = chunk + 1024 < lines ? chunk + 1024 : lines;
        vf sum = splat(0.0f), other = sum;
        for (int64_t line = chunk; line < last; line++) {
            sum += load_f32(p + 16 * line);
            if (VL == 8) other += load_f32(p + 16 * line + 8);
        }
        total += hsum(sum + other);
    }
    return total;
}

/* 512 where the kernels run on AVX-512 (the fast build), 256 on AVX2, 0 elsewhere */
int vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
