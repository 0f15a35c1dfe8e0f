/* A compressed expert's matmuls on the CPU: y = x W^T for the few rows a cold expert
   gets, W in the engine's group-wise int4 / int8 format (`quant.py`), each packed byte
   read once and dequantized in registers, all threads. `cpu_expert_native.py` calls it;
   `native.py` compiles this file (shipped as package data) once per machine.

   A weight's value is exactly `quant.dequantize`'s: c x scale + minimum (asymmetric),
   (c - zero) x scale (zero points), (c - (2^bits - 1) / 2) x scale (symmetric), rounded
   once a step as torch rounds (the multiply and the add are kept apart: no fused
   multiply-add), then to the matrix's dtype (float16 / bfloat16, round to nearest
   even). The sums over the input features are float32 multiply-adds; only their order
   differs from the reference (dequantize, then a float32 matmul).

   Work: pairs of output channels (a tile), all rows of x against them, MAX_R rows at a
   time (the weights of a tile are decoded again for each further MAX_R rows, from L1),
   OpenMP over the pairs. The SwiGLU expert runs in one parallel region: its gate and up
   channels j and I + j make a pair, so silu(gate) x up is written directly, then the
   down matrix's pairs read it.

   int4 with AVX-512, groups a multiple of 32: a group's 16 possible values are computed
   once into one register (the table), and 16 bytes of codes become 32 values by two
   permutes (vpermps reads an index's low 4 bits: the low nibbles, then the bytes shifted
   down by 4). The values come out as the 16 even features then the 16 odd ones of the
   32, so x is stored in that order first (`to_units`). Elsewhere (AVX2, or int8), codes
   widen to floats and take the arithmetic above per vector. Groups that are not a
   multiple of the vector take a scalar path with the same arithmetic.

   Vectors are one register: VL = 16 floats with AVX-512, else 8 (AVX2). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MAX_R 8 /* rows a tile: 2 channels x 8 rows of sums in 32 registers */
#else
#define VL 8
#define MAX_R 4 /* 16 registers */
#endif
#define CHUNK 8 /* channel pairs a thread takes at a time */
/* bytes ahead in a channel's codes prefetched into L2 (prefetcht2) as a group is read:
   one thread from DRAM, int4 at 1 row, 6.2 GB/s without, 8.5-9.1 at 2-4 KB (CI) */
#define PREFETCH_AHEAD 2048

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint8_t vb __attribute__((vector_size(VL)));

enum { F32 = 0, F16 = 1, BF16 = 2 };
enum { FAST4 = 0, FAST8 = 1, SCALAR = 2 };

typedef struct {
    const uint8_t *codes;     /* [rows, groups, group x bits / 8] */
    const uint16_t *scale;    /* [rows, groups] float16 */
    const uint16_t *minimum;  /* [rows, groups] float16 (zero points: the zero); NULL symmetric */
    int64_t rows, cols, group, bits, symmetric, zero_point, dtype;
} Matrix;

typedef struct {
    Matrix in, out;  /* mode 0: y = x in^T; mode 1: y = silu(x gate^T) (x up^T) out^T */
    const float *x;  /* [n, in.cols] */
    float *y;        /* [n, in.rows] or [n, out.rows] */
    float *scratch;  /* n x (in.cols + 2 x in.rows / 2) floats */
    int64_t n, threads, mode;
} Call;

/* the compiler keeps v as computed: a multiply before an add is not fused with it */
#if defined(__x86_64__)
#define KEEP(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define KEEP(v) __asm__("" : "+w"(v))
#else
#define KEEP(v) __asm__("" : "+m"(v))
#endif

static inline vf splat(float x) { return (vf){0} + x; }

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff, bits;
    float f;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        f = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---- rounding to the matrix's dtype (to nearest, ties to even) -------------------- */

static inline float round_scalar(float x, int dtype) {
    uint32_t b;
    if (dtype == BF16) {
        memcpy(&b, &x, 4);
        b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x, &b, 4);
        return x;
    }
    if (dtype == F32) return x;
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    float a = fabsf(x);
    if (a >= 65520.0f) return copysignf(INFINITY, x);
    if (a < 6.103515625e-05f) return nearbyintf(x * 16777216.0f) / 16777216.0f; /* 2^-24 steps */
    memcpy(&b, &x, 4);
    b = (b + 0xfffu + ((b >> 13) & 1u)) & ~0x1fffu;
    memcpy(&x, &b, 4);
    return x;
#endif
}

static inline __attribute__((always_inline)) vf round_vector(vf v, int dtype) {
    if (dtype == F32) return v;
    if (dtype == BF16) {
        vu b = (vu)v;
        return (vf)((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
    }
#if VL == 16
    return (vf)_mm512_cvtph_ps(
        _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(
        _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < VL; i++) v[i] = round_scalar(v[i], F16);
    return v;
#endif
}

/* ---- a group's parameters and values ---------------------------------------------- */

typedef struct {
    float offset, scale, add; /* centred: (c - offset) x scale; else c x scale + add */
} Params;

#define PARAM_BLOCK 16 /* groups whose parameters are converted at once */

/* count (<= PARAM_BLOCK) float16 values as floats */
static inline void halves(const uint16_t *p, int count, float *out) {
#if VL == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
    __mmask16 mask = (__mmask16)((1u << count) - 1u);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)));
#else
    for (int i = 0; i < count; i++) out[i] = half_to_float(p[i]);
#endif
}

static inline int centred(const Matrix *m) { return m->symmetric || m->zero_point; }

/* groups g .. g + count - 1 of a row: scales, and offsets (centred) or minimums */
static inline void load_params(const Matrix *m, int64_t groups, int64_t row, int64_t g,
                               int count, float *scale, float *other) {
    const int64_t at = row * groups + g;
    halves(m->scale + at, count, scale);
    if (!m->symmetric) {
        halves(m->minimum + at, count, other);
    } else {
        for (int i = 0; i < count; i++) other[i] = (float)(((1 << m->bits) - 1) / 2);
    }
}

static inline Params params_of(float scale, float other, int is_centred) {
    Params p = {0.0f, scale, 0.0f};
    if (is_centred)
        p.offset = other;
    else
        p.add = other;
    return p;
}

static inline __attribute__((always_inline)) vf values(vf codes, Params p, int dtype,
                                                       int is_centred) {
    if (is_centred) return round_vector((codes - p.offset) * p.scale, dtype);
    vf product = codes * p.scale;
    KEEP(product);
    return round_vector(product + p.add, dtype);
}

static inline float value_scalar(float code, Params p, int dtype, int is_centred) {
    if (is_centred) return round_scalar((code - p.offset) * p.scale, dtype);
    float product = code * p.scale;
    KEEP(product);
    return round_scalar(product + p.add, dtype);
}

static inline int kind_of(const Matrix *m) {
    if (m->bits == 4 && m->group % (2 * VL) == 0) return FAST4;
    if (m->bits == 8 && m->group % VL == 0) return FAST8;
    return SCALAR;
}

/* VL bytes as 32-bit integers (gcc's generic widening goes byte by byte) */
static inline __attribute__((always_inline)) vi widen(const uint8_t *p) {
#if VL == 16
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb bytes;
    memcpy(&bytes, p, VL);
    return __builtin_convertvector(bytes, vi);
#endif
}

/* VL bytes of int4 codes: the values of their low nibbles (even features) and high
   nibbles (odd features) */
static inline __attribute__((always_inline)) void decode4(const uint8_t *p, vf table, Params q,
                                                          int dtype, int is_centred, vf *even,
                                                          vf *odd) {
#if VL == 16
    (void)q, (void)dtype, (void)is_centred;
    __m512i wide = (__m512i)widen(p);
    *even = (vf)_mm512_permutexvar_ps(wide, (__m512)table);
    *odd = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), (__m512)table);
#else
    (void)table;
    vi wide = widen(p);
    *even = values(__builtin_convertvector(wide & 15, vf), q, dtype, is_centred);
    *odd = values(__builtin_convertvector(wide >> 4, vf), q, dtype, is_centred);
#endif
}

static inline __attribute__((always_inline)) vf decode8(const uint8_t *p, Params q, int dtype,
                                                        int is_centred) {
    return values(__builtin_convertvector(widen(p), vf), q, dtype, is_centred);
}

static inline float hsum(vf v) {
#if VL == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

/* ---- a tile: channels a and b against R rows of x, over groups g0 .. g1 - 1 ---------- */

/* state[c][r] += lanes of W[a or b] . x[r] over the groups; x rows xs floats apart (int4
   fast path: in unit order). is_centred: symmetric or zero points (the C file's top) */
static inline __attribute__((always_inline)) void tile(const Matrix *m, const float *x,
                                                       int64_t xs, int64_t a, int64_t b,
                                                       int64_t g0, int64_t g1,
                                                       vf state[2][MAX_R], const int R,
                                                       const int kind, const int dtype,
                                                       const int is_centred) {
    const int64_t group = m->group, groups = m->cols / group;
    const int64_t group_bytes = group * m->bits / 8;
    const int64_t channel[2] = {a, b};
    const uint8_t *codes[2] = {m->codes + a * groups * group_bytes,
                               m->codes + b * groups * group_bytes};
    /* two chains of sums a (channel, row) where there are registers for them */
    vf acc[2][MAX_R], acc2[2][MAX_R];
    for (int c = 0; c < 2; c++)
        for (int r = 0; r < R; r++) acc[c][r] = state[c][r], acc2[c][r] = splat(0.0f);
    const int twice = R <= MAX_R / 2;
    for (int64_t block = g0; block < g1; block += PARAM_BLOCK) {
        const int count = g1 - block < PARAM_BLOCK ? (int)(g1 - block) : PARAM_BLOCK;
        float scale[2][PARAM_BLOCK], other[2][PARAM_BLOCK];
        for (int c = 0; c < 2; c++)
            load_params(m, groups, channel[c], block, count, scale[c], other[c]);
        for (int i = 0; i < count; i++) {
            const int64_t g = block + i;
            Params q[2];
            vf table[2];
            for (int c = 0; c < 2; c++) {
                q[c] = params_of(scale[c][i], other[c][i], is_centred);
#if VL == 16
                if (kind == FAST4) { /* the dtype's values: one build for all dtypes */
                    const vf all = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
                    table[c] = values(all, q[c], (int)m->dtype, is_centred);
                }
#endif
            }
            const float *xg = x + g * group;
            const uint8_t *p[2] = {codes[0] + g * group_bytes, codes[1] + g * group_bytes};
            for (int c = 0; c < 2; c++)
                for (int64_t line = 0; line < group_bytes; line += 64)
                    __builtin_prefetch(p[c] + PREFETCH_AHEAD + line, 0, 1);
            if (kind == FAST4) {
                for (int64_t u = 0; u < group_bytes; u += VL) {
                    vf even[2], odd[2];
                    for (int c = 0; c < 2; c++)
                        decode4(p[c] + u, table[c], q[c], dtype, is_centred, &even[c], &odd[c]);
                    for (int r = 0; r < R; r++) {
                        vf xe = load_f32(xg + r * xs + 2 * u);
                        vf xo = load_f32(xg + r * xs + 2 * u + VL);
                        for (int c = 0; c < 2; c++) {
                            acc[c][r] += even[c] * xe;
                            if (twice)
                                acc2[c][r] += odd[c] * xo;
                            else
                                acc[c][r] += odd[c] * xo;
                        }
                    }
                }
            } else {
                for (int64_t u = 0; u < group; u += 2 * VL) {
                    for (int half = 0; half < 2; half++) {
                        int64_t at = u + half * VL;
                        if (at >= group) break;
                        vf w[2];
                        for (int c = 0; c < 2; c++)
                            w[c] = decode8(p[c] + at, q[c], dtype, is_centred);
                        for (int r = 0; r < R; r++) {
                            vf xv = load_f32(xg + r * xs + at);
                            for (int c = 0; c < 2; c++) {
                                if (twice && half)
                                    acc2[c][r] += w[c] * xv;
                                else
                                    acc[c][r] += w[c] * xv;
                            }
                        }
                    }
                }
            }
        }
    }
    for (int c = 0; c < 2; c++)
        for (int r = 0; r < R; r++) state[c][r] = acc[c][r] + acc2[c][r];
}

/* any group: one value at a time, the same arithmetic (sums in lane 0) */
static void tile_scalar(const Matrix *m, const float *x, int64_t xs, int64_t a, int64_t b,
                        int64_t g0, int64_t g1, vf state[2][MAX_R], int R) {
    const int64_t group = m->group, groups = m->cols / group;
    const int64_t group_bytes = group * m->bits / 8;
    const int64_t channel[2] = {a, b};
    for (int c = 0; c < 2; c++) {
        const uint8_t *codes = m->codes + channel[c] * groups * group_bytes;
        for (int64_t g = g0; g < g1; g++) {
            float scale[PARAM_BLOCK], other[PARAM_BLOCK]; /* (a whole block is stored) */
            load_params(m, groups, channel[c], g, 1, scale, other);
            Params q = params_of(scale[0], other[0], centred(m));
            for (int64_t i = 0; i < group; i++) {
                int code = m->bits == 8 ? codes[g * group_bytes + i]
                                        : (codes[g * group_bytes + i / 2] >> (4 * (i & 1))) & 15;
                float w = value_scalar((float)code, q, (int)m->dtype, centred(m));
                for (int r = 0; r < R; r++) state[c][r][0] += w * x[r * xs + g * group + i];
            }
        }
    }
}

typedef void (*TileFn)(const Matrix *, const float *, int64_t, int64_t, int64_t, int64_t,
                       int64_t, vf[2][MAX_R]);

/* one build of the tile for each row count, kind, dtype and arithmetic (centred or not) */
#define TILE_FN(kind, dtype, cen, R)                                                         \
    static void tile_##kind##_##dtype##_##cen##_##R(const Matrix *m, const float *x,         \
                                                    int64_t xs, int64_t a, int64_t b,        \
                                                    int64_t g0, int64_t g1,                  \
                                                    vf s[2][MAX_R]) {                        \
        tile(m, x, xs, a, b, g0, g1, s, R, kind, dtype, cen);                                \
    }
#if MAX_R == 8
#define TILE_ROWS(kind, dtype, cen)                                                          \
    TILE_FN(kind, dtype, cen, 1) TILE_FN(kind, dtype, cen, 2) TILE_FN(kind, dtype, cen, 3)   \
    TILE_FN(kind, dtype, cen, 4) TILE_FN(kind, dtype, cen, 5) TILE_FN(kind, dtype, cen, 6)   \
    TILE_FN(kind, dtype, cen, 7) TILE_FN(kind, dtype, cen, 8)
#define TILE_LIST(kind, dtype, cen)                                                          \
    {tile_##kind##_##dtype##_##cen##_1, tile_##kind##_##dtype##_##cen##_2,                   \
     tile_##kind##_##dtype##_##cen##_3, tile_##kind##_##dtype##_##cen##_4,                   \
     tile_##kind##_##dtype##_##cen##_5, tile_##kind##_##dtype##_##cen##_6,                   \
     tile_##kind##_##dtype##_##cen##_7, tile_##kind##_##dtype##_##cen##_8}
#else
#define TILE_ROWS(kind, dtype, cen)                                                          \
    TILE_FN(kind, dtype, cen, 1) TILE_FN(kind, dtype, cen, 2) TILE_FN(kind, dtype, cen, 3)   \
    TILE_FN(kind, dtype, cen, 4)
#define TILE_LIST(kind, dtype, cen)                                                          \
    {tile_##kind##_##dtype##_##cen##_1, tile_##kind##_##dtype##_##cen##_2,                   \
     tile_##kind##_##dtype##_##cen##_3, tile_##kind##_##dtype##_##cen##_4}
#endif
#define TILE_KINDS(kind, dtype) TILE_ROWS(kind, dtype, 0) TILE_ROWS(kind, dtype, 1)
#define TILE_TABLE(kind, dtype) {TILE_LIST(kind, dtype, 0), TILE_LIST(kind, dtype, 1)}

/* int4's AVX-512 table holds the dtype's values: its loop is the same for every dtype */
#if VL == 16
TILE_KINDS(FAST4, F32)
static const TileFn TILES4[3][2][MAX_R] = {TILE_TABLE(FAST4, F32), TILE_TABLE(FAST4, F32),
                                           TILE_TABLE(FAST4, F32)};
#else
TILE_KINDS(FAST4, F32) TILE_KINDS(FAST4, F16) TILE_KINDS(FAST4, BF16)
static const TileFn TILES4[3][2][MAX_R] = {TILE_TABLE(FAST4, F32), TILE_TABLE(FAST4, F16),
                                           TILE_TABLE(FAST4, BF16)};
#endif
TILE_KINDS(FAST8, F32) TILE_KINDS(FAST8, F16) TILE_KINDS(FAST8, BF16)
static const TileFn TILES8[3][2][MAX_R] = {TILE_TABLE(FAST8, F32), TILE_TABLE(FAST8, F16),
                                           TILE_TABLE(FAST8, BF16)};

/* ---- panels of channel pairs over all rows --------------------------------------------- */

/* floats of x rows a pass over the groups keeps in L1 (16 KB) */
#ifndef X_FLOATS
#define X_FLOATS 4096
#endif

typedef struct {
    float *y;      /* row r's result of channel c at y[r x stride + c] */
    int64_t stride;
    int64_t count; /* channels (glu: the gate's, = stride) */
    int glu;       /* pairs are (gate j, up j), y gets silu(gate) x up */
} Out;

static inline void channels(const Out *o, int64_t p, int64_t *a, int64_t *b) {
    if (o->glu) {
        *a = p, *b = p + o->count;
    } else {
        *a = 2 * p, *b = 2 * p + 1 < o->count ? 2 * p + 1 : 2 * p;
    }
}

/* pairs p0 .. p1 - 1 (at most CHUNK) against all n rows of x: MAX_R rows at a time, the
   groups in passes whose x rows stay in L1, every pair of the panel in each pass */
static void panel(const Matrix *m, const float *x, int64_t xs, int64_t n, int64_t p0,
                  int64_t p1, const Out *o) {
    const int kind = kind_of(m), dtype = (int)m->dtype, cen = centred(m);
    const int64_t groups = m->cols / m->group;
    vf state[CHUNK][2][MAX_R];
    for (int64_t r0 = 0; r0 < n; r0 += MAX_R) {
        const int R = n - r0 < MAX_R ? (int)(n - r0) : MAX_R;
        int64_t step = X_FLOATS / R / m->group;
        step = step < 1 ? 1 : step;
        memset(state, 0, sizeof state);
        const float *xr = x + r0 * xs;
        for (int64_t g0 = 0; g0 < groups; g0 += step) {
            const int64_t g1 = g0 + step < groups ? g0 + step : groups;
            for (int64_t p = p0; p < p1; p++) {
                int64_t a, b;
                channels(o, p, &a, &b);
                if (kind == FAST4)
                    TILES4[dtype][cen][R - 1](m, xr, xs, a, b, g0, g1, state[p - p0]);
                else if (kind == FAST8)
                    TILES8[dtype][cen][R - 1](m, xr, xs, a, b, g0, g1, state[p - p0]);
                else
                    tile_scalar(m, xr, xs, a, b, g0, g1, state[p - p0], R);
            }
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t a, b;
            channels(o, p, &a, &b);
            for (int r = 0; r < R; r++) {
                const float first = hsum(state[p - p0][0][r]), second = hsum(state[p - p0][1][r]);
                float *y = o->y + (r0 + r) * o->stride;
                if (o->glu) {
                    y[a] = first / (1.0f + expf(-first)) * second;
                } else {
                    y[a] = first;
                    y[b] = second;
                }
            }
        }
    }
}

/* every pair of the matrix, panels spread over the threads (inside a parallel region) */
static void pairs(const Matrix *m, const float *x, int64_t xs, int64_t n, const Out *o) {
    const int64_t count = o->glu ? o->count : (o->count + 1) / 2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t p0 = 0; p0 < count; p0 += CHUNK)
        panel(m, x, xs, n, p0, p0 + CHUNK < count ? p0 + CHUNK : count, o);
}

/* x rows into int4's unit order: each 2 VL features, the even ones then the odd ones */
static void to_units(const float *x, int64_t cols, float *out) {
    for (int64_t u = 0; u < cols; u += 2 * VL)
        for (int i = 0; i < VL; i++) {
            out[u + i] = x[u + 2 * i];
            out[u + VL + i] = x[u + 2 * i + 1];
        }
}

/* the rows x (n x cols, natural order) as the matrix reads them: unit order for int4 */
static const float *operand(const Matrix *m, const float *x, int64_t n, float *scratch) {
    if (kind_of(m) != FAST4) return x;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++) to_units(x + r * m->cols, m->cols, scratch + r * m->cols);
    return scratch;
}

static int valid(const Matrix *m) {
    return (m->bits == 4 || m->bits == 8) && m->group > 0 && m->cols % m->group == 0 &&
           (m->bits == 8 || m->group % 2 == 0) && m->dtype >= 0 && m->dtype <= 2 &&
           (m->symmetric || m->minimum);
}

int expert(const Call *call) {
    const Matrix *in = &call->in, *out = &call->out;
    const int64_t n = call->n, inner = in->rows / 2;
    if (!valid(in) || n < 1) return 1;
    if (call->mode == 1 && (!valid(out) || in->rows % 2 || out->cols != inner)) return 1;
    float *xp = call->scratch, *act = xp + n * in->cols, *actp = act + n * inner;
    const Out linear = {call->y, in->rows, in->rows, 0};
    const Out glu = {act, inner, inner, 1}, down = {call->y, out->rows, out->rows, 0};
#pragma omp parallel num_threads(call->threads)
    {
        const float *x = operand(in, call->x, n, xp); /* (each omp for ends in a barrier) */
        if (call->mode == 0) {
            pairs(in, x, in->cols, n, &linear);
        } else {
            pairs(in, x, in->cols, n, &glu);
            pairs(out, operand(out, act, n, actp), inner, n, &down);
        }
    }
    return 0;
}

/* reads nbytes (a multiple of 64) with `threads` threads; returns a sum so it is kept */
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

/* 512 where the kernel runs on AVX-512, 256 on AVX2, 0 elsewhere */
int vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
