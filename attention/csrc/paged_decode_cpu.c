/*
 * Paged decode attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * Why C: the plain-torch path must first gather every sequence's blocks into a contiguous
 * tensor per layer (a full copy of the context's K and V) before SDPA reads it again. Here a
 * thread walks a sequence's block table once for the scores and once for the weighted sum of
 * values, so K and V are read once and never copied. Built and loaded by
 * attention/kernel_library.py with the system C compiler; the torch reference stays the oracle.
 *
 * Work items: with at least two decodes per thread, one item is a whole sequence, all its
 * heads, so each K/V row loaded is a token's contiguous [num_kv_heads, head_dim] slice. With
 * fewer (one user's long decode), an item is one (sequence, KV head) pair, so that every thread
 * has work.
 *
 * Speed: on a CPU with AVX-512, head sizes that are a multiple of 16 up to 256 with at most 8
 * query heads per KV head take attend_sequence_avx512_* (each K/V row loaded once for its query
 * heads, queries and accumulators in registers, 16 scores summed across lanes together,
 * exponentials 16 at a time): 2x the portable loop at 64 sequences of 400 tokens. Either way the next block is prefetched while one is computed, since
 * blocks lie anywhere in the pool. Past that the kernel is bound by memory bandwidth: a decode
 * reads every cached K and V once.
 *
 * Layout (the same as the torch and Triton backends):
 *   query        [num_tokens, num_heads, head_dim], rows `query_stride` elements apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, block_table_stride] int32; sequence s reads row table_rows[s]
 *                where table_rows is given (rows of one prefill chunk share their sequence's)
 *   out          [num_tokens, num_heads, head_dim], rows `out_stride` elements apart
 * Query head h reads KV head h / G, G = num_heads / num_kv_heads (GQA).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"

/* Rows of K/V as float32: float32 caches are read where they lie, others are converted into the
 * caller's scratch row first. */
static inline const float* row_f32(float* scratch, const float* src, int64_t n) {
    (void)scratch;
    (void)n;
    return src;
}
static inline const float* row_bf16(float* scratch, const uint16_t* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) scratch[i] = bf16_to_f32(src[i]);
    return scratch;
}
static inline void store_f32(float* dst, const float* src, int64_t n) {
    memcpy(dst, src, sizeof(float) * n);
}
static inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
#ifdef __FLT16_MAX__
static inline const float* row_f16(float* scratch, const _Float16* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) scratch[i] = (float)src[i];
    return scratch;
}
static inline void store_f16(_Float16* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = (_Float16)src[i];
}
#endif

/* Scratch per thread, in floats: scores [num_heads][score_stride], query and output accumulators
 * [num_heads][head_dim], one converted K/V token row [num_kv_heads][head_dim]. */
#define SCRATCH_FLOATS(num_heads, num_kv_heads, head_dim, score_stride) \
    ((num_heads) * (score_stride) + 2 * (num_heads) * (head_dim) + (num_kv_heads) * (head_dim))
/* A row of scores starts 64-byte aligned (the scratch is, the stride a multiple of 16 floats),
 * whatever the batch's longest sequence: a vectorized loop the compiler peels for alignment then
 * sums a row in the same order in every batch, which a row's result must not depend on. */
#define SCORE_STRIDE(max_seq_len) (((max_seq_len) + 15) / 16 * 16)

DEFINE_THREAD_SCRATCH(scratch_for)

/* Query heads of KV heads [kv_begin, kv_end) of one sequence, for element type T (here and in
 * the AVX-512 variant, `max_seq_len` is the scores' row stride: SCORE_STRIDE). `head_dim`
 * is a compile-time constant at the call sites for the common sizes, which lets the compiler
 * unroll the dot products fully. Rows of scores and accumulators are indexed by query head. */
#define DEFINE_ATTEND_SEQUENCE(SUFFIX, T)                                                           \
    static inline __attribute__((always_inline)) void attend_sequence_##SUFFIX(                   \
        const T* query_row, const T* key_cache, const T* value_cache, const int32_t* table,       \
        int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t kv_begin, int64_t kv_end,   \
        const int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale,             \
        T* out_row, float* scratch) {                                                             \
        const int64_t group = num_heads / num_kv_heads;                                           \
        const int64_t token_stride = num_kv_heads * head_dim;                                     \
        const int64_t block_stride = block_size * token_stride;                                   \
        const int64_t num_blocks = (len + block_size - 1) / block_size;                           \
        const int64_t h_begin = kv_begin * group, h_end = kv_end * group;                         \
        const int64_t row_offset = kv_begin * head_dim; /* first K/V element this item reads */  \
        const int64_t row_len = (kv_end - kv_begin) * head_dim;                                   \
        float* scores = scratch;                                                                  \
        float* q = scores + num_heads * max_seq_len;                                              \
        float* acc = q + num_heads * head_dim;                                                    \
        float* tmp = acc + num_heads * head_dim;                                                  \
        /* Converted in place into q where needed (tmp holds one K/V row, not all the heads). */ \
        const float* q_in = row_##SUFFIX(q + h_begin * head_dim, query_row + h_begin * head_dim,  \
                                         (h_end - h_begin) * head_dim);                           \
        for (int64_t i = 0; i < (h_end - h_begin) * head_dim; ++i)                                \
            q[h_begin * head_dim + i] = q_in[i] * scale;                                          \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* block = key_cache + (int64_t)table[b] * block_stride + row_offset;           \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            if (b + 1 < num_blocks)                                                               \
                prefetch_rows(key_cache + (int64_t)table[b + 1] * block_stride + row_offset,      \
                              block_size, token_stride, row_len * (int64_t)sizeof(T));            \
            for (int64_t p = 0; p < filled; ++p) {                                                \
                const float* k_row = row_##SUFFIX(tmp, block + p * token_stride, row_len);        \
                for (int64_t h = h_begin; h < h_end; ++h) {                                       \
                    const float* k = k_row + (h / group - kv_begin) * head_dim;                   \
                    const float* qh = q + h * head_dim;                                           \
                    float dot = 0.f;                                                              \
                    PRAGMA(omp simd reduction(+ : dot))                                           \
                    for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * k[i];                   \
                    scores[h * max_seq_len + b * block_size + p] = dot;                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t h = h_begin; h < h_end; ++h) {                                               \
            float* s = scores + h * max_seq_len;                                                  \
            float top = -FLT_MAX, sum = 0.f;                                                      \
            for (int64_t p = 0; p < len; ++p) top = s[p] > top ? s[p] : top;                      \
            PRAGMA(omp simd reduction(+ : sum))                                                   \
            for (int64_t p = 0; p < len; ++p) {                                                   \
                s[p] = expf(s[p] - top);                                                          \
                sum += s[p];                                                                      \
            }                                                                                     \
            const float inv = 1.f / sum;                                                          \
            for (int64_t p = 0; p < len; ++p) s[p] *= inv;                                        \
        }                                                                                         \
        memset(acc + h_begin * head_dim, 0, sizeof(float) * (h_end - h_begin) * head_dim);        \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* block = value_cache + (int64_t)table[b] * block_stride + row_offset;         \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            if (b + 1 < num_blocks)                                                               \
                prefetch_rows(value_cache + (int64_t)table[b + 1] * block_stride + row_offset,    \
                              block_size, token_stride, row_len * (int64_t)sizeof(T));            \
            for (int64_t p = 0; p < filled; ++p) {                                                \
                const float* v_row = row_##SUFFIX(tmp, block + p * token_stride, row_len);        \
                for (int64_t h = h_begin; h < h_end; ++h) {                                       \
                    const float* v = v_row + (h / group - kv_begin) * head_dim;                   \
                    const float w = scores[h * max_seq_len + b * block_size + p];                 \
                    float* a = acc + h * head_dim;                                                \
                    PRAGMA(omp simd)                                                              \
                    for (int64_t i = 0; i < head_dim; ++i) a[i] += w * v[i];                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        store_##SUFFIX(out_row + h_begin * head_dim, acc + h_begin * head_dim,                    \
                       (h_end - h_begin) * head_dim);                                             \
    }

#ifdef HAVE_AVX512_PATH
/* The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]): pairs, then quads
 * within each 128-bit lane, then across lanes; about 2 shuffles a sum against 4 for
 * _mm512_reduce_add_ps, and no chain between them. */
static inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i) /* lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* lane: partial sums of v[4i .. 4i + 3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Softmax of s[0, len) in place. */
static inline void softmax_avx512(float* s, int64_t len) {
    __m512 top = _mm512_set1_ps(-FLT_MAX);
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + p));
    float m = _mm512_reduce_max_ps(top);
    for (; p < len; ++p) m = s[p] > m ? s[p] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (p = 0; p < len; p += 16) {
        const __mmask16 live = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + p), mv));
        _mm512_mask_storeu_ps(s + p, live, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (p = 0; p < len; p += 16) {
        const __mmask16 live = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1);
        _mm512_mask_storeu_ps(s + p, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + p), inv));
    }
}

/* One KV head of one sequence and its `group` query heads, for head_dim = 16 * vecs up to 256:
 * each K and V row is loaded once for all the query heads that read it (GQA), a block's 16
 * scores per head are summed across lanes together (sum16), the softmax's exponentials go 16 at
 * a time. `group` and `vecs` are constants at the call sites, so the loops over them unroll. */
#define MAX_VECS 16
#define MAX_GROUP 8
#define DEFINE_ATTEND_KV_AVX512(SUFFIX, T)                                                         \
    static inline __attribute__((always_inline)) void attend_kv_avx512_##SUFFIX(                  \
        const T* query_row, const T* key_cache, const T* value_cache, const int32_t* table,       \
        int64_t len, int64_t num_kv_heads, int64_t kv, const int64_t group, const int64_t vecs,   \
        int64_t block_size, int64_t max_seq_len, float scale, T* out_row, float* scores) {        \
        const int64_t head_dim = 16 * vecs;                                                       \
        const int64_t token_stride = num_kv_heads * head_dim;                                     \
        const int64_t block_stride = block_size * token_stride;                                   \
        const int64_t num_blocks = (len + block_size - 1) / block_size;                           \
        const int64_t h0 = kv * group;                                                            \
        const int64_t row_bytes = head_dim * (int64_t)sizeof(T);                                  \
        __m512 q[MAX_GROUP][MAX_VECS], a[MAX_GROUP][MAX_VECS], dots[MAX_GROUP][16];              \
        const __m512 sv = _mm512_set1_ps(scale);                                                  \
        for (int64_t g = 0; g < group; ++g)                                                       \
            for (int64_t j = 0; j < vecs; ++j) {                                                  \
                q[g][j] = _mm512_mul_ps(load16_##SUFFIX(query_row + (h0 + g) * head_dim + 16 * j),\
                                        sv);                                                      \
                a[g][j] = _mm512_setzero_ps();                                                    \
            }                                                                                     \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* k = key_cache + (int64_t)table[b] * block_stride + kv * head_dim;            \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            if (b + 1 < num_blocks)                                                               \
                prefetch_rows(key_cache + (int64_t)table[b + 1] * block_stride + kv * head_dim,   \
                              block_size, token_stride, row_bytes);                               \
            int64_t p = 0;                                                                        \
            for (; p + 16 <= filled; p += 16) {                                                   \
                for (int64_t t = 0; t < 16; ++t) {                                                \
                    const T* kp = k + (p + t) * token_stride;                                     \
                    __m512 kr[MAX_VECS];                                                          \
                    for (int64_t j = 0; j < vecs; ++j) kr[j] = load16_##SUFFIX(kp + 16 * j);      \
                    for (int64_t g = 0; g < group; ++g) {                                         \
                        __m512 dot = _mm512_mul_ps(q[g][0], kr[0]);                               \
                        for (int64_t j = 1; j < vecs; ++j)                                        \
                            dot = _mm512_fmadd_ps(q[g][j], kr[j], dot);                           \
                        dots[g][t] = dot;                                                         \
                    }                                                                             \
                }                                                                                 \
                for (int64_t g = 0; g < group; ++g)                                               \
                    _mm512_storeu_ps(scores + g * max_seq_len + b * block_size + p,               \
                                     sum16(dots[g]));                                             \
            }                                                                                     \
            for (; p < filled; ++p) {                                                             \
                const T* kp = k + p * token_stride;                                               \
                for (int64_t g = 0; g < group; ++g) {                                             \
                    __m512 dot = _mm512_mul_ps(q[g][0], load16_##SUFFIX(kp));                     \
                    for (int64_t j = 1; j < vecs; ++j)                                            \
                        dot = _mm512_fmadd_ps(q[g][j], load16_##SUFFIX(kp + 16 * j), dot);        \
                    scores[g * max_seq_len + b * block_size + p] = _mm512_reduce_add_ps(dot);     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; ++g) softmax_avx512(scores + g * max_seq_len, len);        \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                \
            const T* v = value_cache + (int64_t)table[b] * block_stride + kv * head_dim;          \
            const int64_t filled = b + 1 < num_blocks ? block_size : len - b * block_size;        \
            if (b + 1 < num_blocks)                                                               \
                prefetch_rows(value_cache + (int64_t)table[b + 1] * block_stride + kv * head_dim, \
                              block_size, token_stride, row_bytes);                               \
            for (int64_t p = 0; p < filled; ++p) {                                                \
                const T* vp = v + p * token_stride;                                               \
                __m512 vr[MAX_VECS];                                                              \
                for (int64_t j = 0; j < vecs; ++j) vr[j] = load16_##SUFFIX(vp + 16 * j);          \
                for (int64_t g = 0; g < group; ++g) {                                             \
                    const __m512 w = _mm512_set1_ps(scores[g * max_seq_len + b * block_size + p]);\
                    for (int64_t j = 0; j < vecs; ++j) a[g][j] = _mm512_fmadd_ps(w, vr[j], a[g][j]);\
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; ++g) {                                                     \
            float row[16 * MAX_VECS];                                                             \
            for (int64_t j = 0; j < vecs; ++j) _mm512_storeu_ps(row + 16 * j, a[g][j]);           \
            store_##SUFFIX(out_row + (h0 + g) * head_dim, row, head_dim);                         \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* The contract of attend_sequence_*: KV heads [kv_begin, kv_end) one after the other. */     \
    static inline __attribute__((always_inline)) void attend_sequence_avx512_##SUFFIX(            \
        const T* query_row, const T* key_cache, const T* value_cache, const int32_t* table,       \
        int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t kv_begin, int64_t kv_end,   \
        const int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale,             \
        T* out_row, float* scratch) {                                                             \
        const int64_t group = num_heads / num_kv_heads;                                           \
        for (int64_t kv = kv_begin; kv < kv_end; ++kv) {                                          \
            switch (group) {                                                                      \
                case 1: attend_kv_avx512_##SUFFIX(KV_ARGS(1)); break;                             \
                case 2: attend_kv_avx512_##SUFFIX(KV_ARGS(2)); break;                             \
                case 4: attend_kv_avx512_##SUFFIX(KV_ARGS(4)); break;                             \
                default: attend_kv_avx512_##SUFFIX(KV_ARGS(group));                               \
            }                                                                                     \
        }                                                                                         \
    }
#define KV_ARGS(GROUP)                                                                            \
    query_row, key_cache, value_cache, table, len, num_kv_heads, kv, (GROUP), head_dim / 16,     \
        block_size, max_seq_len, scale, out_row, scratch
#endif

/* Return codes of the entry points. */
#define PAGED_DECODE_OK 0
#define PAGED_DECODE_NO_MEMORY -1 /* a thread could not allocate its scratch */
#define PAGED_DECODE_BAD_LENGTH -2 /* a seq_len outside [1, max_seq_len]: nothing read for it */

/* The exported entry point: work items in parallel, the head size made constant where it is a
 * common one. */
#define ATTEND_ARGS(HEAD_DIM)                                                                     \
    q, key_cache, value_cache, table, len, num_heads, num_kv_heads, kv_begin, kv_end, (HEAD_DIM), \
        block_size, score_stride, scale, o, scratch
/* FAST: attend_sequence_avx512_* where this CPU and element type have it, for head sizes that are
 * a multiple of 16 up to 256; else the portable attend_sequence_* again. */
#define DEFINE_PAGED_DECODE(SUFFIX, T, FAST)                                                        \
    int paged_decode_##SUFFIX(                                                                    \
        const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,           \
        const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,         \
        const int32_t* query_start_loc, const int64_t* decode_seqs, int64_t num_decodes,          \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,            \
        int64_t max_seq_len, float scale, T* out, int64_t out_stride, int64_t num_threads,        \
        const int64_t* table_rows) {                                                              \
        int status = PAGED_DECODE_OK;                                                             \
        const int64_t score_stride = SCORE_STRIDE(max_seq_len);                                   \
        const int64_t splits = num_decodes >= 2 * num_threads ? 1 : num_kv_heads;                 \
        const int64_t kv_per_item = num_kv_heads / splits;                                        \
        const int fast = head_dim % 16 == 0 && head_dim <= 16 * MAX_VECS &&                        \
                         num_heads / num_kv_heads <= MAX_GROUP;                                   \
        const size_t scratch_floats =                                                             \
            (size_t)SCRATCH_FLOATS(num_heads, num_kv_heads, head_dim, score_stride);             \
        (void)num_threads; /* without OpenMP: one thread */                                       \
        PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(num_threads))                    \
        for (int64_t item = 0; item < num_decodes * splits; ++item) {                             \
            const int64_t seq = decode_seqs[item / splits];                                       \
            const int64_t kv_begin = (item % splits) * kv_per_item;                               \
            const int64_t len = seq_lens[seq];                                                    \
            float* scratch = scratch_for(scratch_floats);                                         \
            if (len < 1 || len > max_seq_len || scratch == NULL) {                                \
                PRAGMA(omp atomic write)                                                          \
                status = scratch == NULL ? PAGED_DECODE_NO_MEMORY : PAGED_DECODE_BAD_LENGTH;      \
                continue;                                                                         \
            }                                                                                     \
            const int64_t row = query_start_loc[seq];                                             \
            const T* q = query + row * query_stride;                                              \
            T* o = out + row * out_stride;                                                        \
            const int64_t table_row = table_rows == NULL ? seq : table_rows[seq];                 \
            const int32_t* table = block_tables + table_row * block_table_stride;                 \
            const int64_t kv_end = kv_begin + kv_per_item;                                        \
            if (fast) {                                                                           \
                switch (head_dim) {                                                               \
                    case 64: FAST(ATTEND_ARGS(64)); break;                                        \
                    case 128: FAST(ATTEND_ARGS(128)); break;                                      \
                    default: FAST(ATTEND_ARGS(head_dim));                                         \
                }                                                                                 \
            } else {                                                                              \
                switch (head_dim) {                                                               \
                    case 64: attend_sequence_##SUFFIX(ATTEND_ARGS(64)); break;                    \
                    case 128: attend_sequence_##SUFFIX(ATTEND_ARGS(128)); break;                  \
                    default: attend_sequence_##SUFFIX(ATTEND_ARGS(head_dim));                     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return status;                                                                            \
    }

/* How many threads a parallel region of `num_threads` gets here: 1 without OpenMP. */
int parallel_width(int64_t num_threads) {
    int width = 1;
    (void)num_threads;
    PRAGMA(omp parallel num_threads(num_threads))
    {
        PRAGMA(omp single)
        {
#ifdef _OPENMP
            width = omp_get_num_threads();
#endif
        }
    }
    return width;
}

DEFINE_ATTEND_SEQUENCE(f32, float)
DEFINE_ATTEND_SEQUENCE(bf16, uint16_t)
#ifdef HAVE_AVX512_PATH
DEFINE_ATTEND_KV_AVX512(f32, float)
DEFINE_ATTEND_KV_AVX512(bf16, uint16_t)
DEFINE_PAGED_DECODE(f32, float, attend_sequence_avx512_f32)
DEFINE_PAGED_DECODE(bf16, uint16_t, attend_sequence_avx512_bf16)
#else
#define MAX_VECS 16
#define MAX_GROUP 8
DEFINE_PAGED_DECODE(f32, float, attend_sequence_f32)
DEFINE_PAGED_DECODE(bf16, uint16_t, attend_sequence_bf16)
#endif
#ifdef __FLT16_MAX__
DEFINE_ATTEND_SEQUENCE(f16, _Float16)
DEFINE_PAGED_DECODE(f16, _Float16, attend_sequence_f16)
int has_f16(void) { return 1; }
#else
int has_f16(void) { return 0; }
#endif
