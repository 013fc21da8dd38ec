/*
 * Paged attention of tiles of query rows, each row computed in an order fixed by its own context.
 *
 * Why: a token's logits must be the same bits whether its context was computed by a prefill, in
 * chunks, one decode step at a time or beside other requests; otherwise a seeded stream resumed
 * on another engine, a preempted request recomputed or a turn behind a cached prefix can draw
 * another token where a draw falls within that rounding. The prefill kernels (torch's flash
 * SDPA, csrc/paged_prefill_cpu.c) split a row's keys by how many rows they tile together; the
 * decode kernel sums each row alone but rereads its whole context for every row of a prompt
 * (2-2.7x the prefill kernels at 2-4K tokens), and a prefix that many decodes share once per
 * decode. Here a tile is up to `max_tile_rows` query rows: consecutive rows of one sequence, or
 * the decodes of sequences whose block tables begin with the same blocks (a shared prefix). Each
 * key block the tile's rows share is read once for all of them and their query heads, and every
 * (row, key) score, softmax and weighted sum is the same sequence of operations whatever the tile
 * holds:
 *   score   a dot product of W-lane partial sums over head_dim (W = 8, 16 with AVX-512), summed
 *           across lanes by one fixed tree (sum_lanes_each), in a full group of W keys or a tail;
 *   softmax the row's max (exact in any order), exponentials W at a time (element-wise), their
 *           sum in W lanes from key 0 on, lanes summed by a fixed tree: a function of the row's
 *           own length only;
 *   values  each output lane a chain over the row's keys in order, scaled by 1 / sum at the end.
 * Associative math is off for this file (-fno-associative-math, attention/kernel_library.py) so the
 * compiler cannot regroup those sums differently where a tile's loops unroll differently (FMA
 * contraction stays on: each a * b + c is fused the same way at both places score_block and
 * value_block are inlined, the shared blocks' walk and an entry's own, which the tests check on
 * the build host's arithmetic and on the 16-lane one).
 *
 * Layout (as csrc/paged_decode_cpu.c):
 *   query, out   [num_tokens, num_heads, head_dim], rows `query_stride` / `out_stride` apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, block_table_stride] int32
 *   entries      [num_entries, 3] int64: a query row, the keys it sees, its block_tables row
 *   tiles        [num_tiles, 3] int64: its first entry, how many, and how many leading blocks
 *                are the same in all their tables (read once for all of them)
 * head_dim must be a multiple of W (paged_rows_lanes()). Query head h reads KV head h / G,
 * G = num_heads / num_kv_heads.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

/* Lanes of a vector: 16 where the compiler targets AVX-512, else 8 (AVX2, or pairs of SSE/NEON
 * registers). A row's bits are then those of one instruction set, as the other kernels' are.
 * PAGEDRAY_ROWS_W16 asks for 16 anywhere (GCC splits the vectors), to test that arithmetic on a
 * CPU without AVX-512. */
#if defined(__AVX512F__) || defined(PAGEDRAY_ROWS_W16)
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

#ifdef __clang__
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline vf load_lanes(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store_lanes(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float c) { return (vf){0} + c; }
static inline vf select_lanes(vi mask, vf yes, vf no) {
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}

#if W == 16
/* Lane t = the sum of d[t]'s 16 lanes by one tree, the same for every t: pairs, then quads,
 * octets, halves. */
static inline vf sum_lanes_each(const vf* d) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = SHUFFLE(d[2 * i], d[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                       14, 30) +
               SHUFFLE(d[2 * i], d[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                       15, 31);
    for (int j = 0; j < 4; ++j)
        b[j] = SHUFFLE(a[2 * j], a[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13,
                       28, 29) +
               SHUFFLE(a[2 * j], a[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                       30, 31);
    for (int k = 0; k < 2; ++k)
        c[k] = SHUFFLE(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                       26, 27) +
               SHUFFLE(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                       30, 31);
    return SHUFFLE(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(c[0], c[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline float sum_lanes(vf v) {
    return (((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))) +
           (((v[8] + v[9]) + (v[10] + v[11])) + ((v[12] + v[13]) + (v[14] + v[15])));
}
#else
/* Lane t = the sum of d[t]'s 8 lanes, ((0+1)+(2+3))+((4+5)+(6+7)) for every t. */
static inline vf sum_lanes_each(const vf* d) {
    vf a[4], b[2];
    for (int i = 0; i < 4; ++i)
        a[i] = SHUFFLE(d[2 * i], d[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SHUFFLE(d[2 * i], d[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int j = 0; j < 2; ++j)
        b[j] = SHUFFLE(a[2 * j], a[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE(a[2 * j], a[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline float sum_lanes(vf v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
#endif

/* e^x for x <= 0, element-wise, to about 1 ulp (the AVX-512 kernels' polynomial). */
static inline vf exp_nonpositive_lanes(vf x) {
    x = select_lanes(x < splat(-87.f), splat(-87.f), x); /* below: 0 after scaling, no denormals */
    const vi n = __builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), vi);
    const vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * splat(0.693145751953125f);
    r = r - nf * splat(1.428606765330187045e-06f);
    vf p = splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    return p * (vf)((n + 127) << 23);
}

/* Exponentials of s[0, len) - max in place (lanes up to the next multiple of W are written, as 0);
 * returns their sum. */
static inline float softmax_numerators(float* s, int64_t len) {
    vf top = splat(-FLT_MAX);
    int64_t p = 0;
    for (; p + W <= len; p += W) {
        const vf x = load_lanes(s + p);
        top = select_lanes(x > top, x, top);
    }
    float m = -FLT_MAX;
    for (int l = 0; l < W; ++l) m = top[l] > m ? top[l] : m;
    for (; p < len; ++p) m = s[p] > m ? s[p] : m;
    vi lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    vf sum = splat(0.f);
    for (p = 0; p < len; p += W) {
        const vi live = lane < (vi){0} + (int32_t)(len - p);
        const vf e =
            select_lanes(live, exp_nonpositive_lanes(load_lanes(s + p) - splat(m)), splat(0.f));
        store_lanes(s + p, e);
        sum += e;
    }
    return sum_lanes(sum);
}

/* A block's K or V token rows (`row_len` elements of each, `token_stride` apart) as float32:
 * float32 read where they lie, others converted into `buffer` (rows row_len apart). Sets the row
 * stride. */
static inline const float* block_rows_f32(float* buffer, const float* src, int64_t rows,
                                          int64_t token_stride, int64_t row_len,
                                          int64_t* stride) {
    (void)buffer;
    (void)rows;
    (void)row_len;
    *stride = token_stride;
    return src;
}
static inline const float* block_rows_bf16(float* buffer, const uint16_t* src, int64_t rows,
                                           int64_t token_stride, int64_t row_len,
                                           int64_t* stride) {
    for (int64_t p = 0; p < rows; ++p)
        for (int64_t i = 0; i < row_len; ++i)
            buffer[p * row_len + i] = bf16_to_f32(src[p * token_stride + i]);
    *stride = row_len;
    return buffer;
}
static inline float load_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline void store_f32(float* dst, float x) { *dst = x; }
static inline void store_bf16(uint16_t* dst, float x) { *dst = f32_to_bf16(x); }

/* acc[0, CH*W) += w[p] * v_p[0, CH*W) for p in [0, keys), in order: one chain per lane. */
#define DEFINE_WEIGHTED_SUM(CH)                                                                    \
    static inline __attribute__((always_inline)) void weighted_sum_##CH(                          \
        float* acc, const float* w, const float* v, int64_t v_stride, int64_t keys) {             \
        vf a[CH];                                                                                  \
        for (int u = 0; u < CH; ++u) a[u] = load_lanes(acc + u * W);                               \
        for (int64_t p = 0; p < keys; ++p) {                                                       \
            const vf wp = splat(w[p]);                                                             \
            for (int u = 0; u < CH; ++u) a[u] += wp * load_lanes(v + p * v_stride + u * W);        \
        }                                                                                          \
        for (int u = 0; u < CH; ++u) store_lanes(acc + u * W, a[u]);                               \
    }
DEFINE_WEIGHTED_SUM(8)
DEFINE_WEIGHTED_SUM(4)
DEFINE_WEIGHTED_SUM(1)

/* Scratch per thread, in floats: scores [n][score_stride], queries and accumulators [n][head_dim],
 * a block's token rows as float32 [block_size][token_stride], a row of zeros and [n] reciprocal
 * sums; n = max_tile_rows times the query heads of a work item. */
#define ROWS_SCRATCH_FLOATS(n, head_dim, block_size, token_stride, score_stride) \
    ((n) * (score_stride) + 2 * (n) * (head_dim) + (block_size) * (token_stride) + (head_dim) + (n))
/* Room for a group of W scores past the longest row, rows 64-byte aligned. */
#define ROWS_SCORE_STRIDE(max_seq_len) (((max_seq_len) + W + 15) / 16 * 16)

DEFINE_THREAD_SCRATCH(rows_scratch_for)

/* Block b of a walk over `cache` (K or V) by `table`, `num_blocks` blocks long, of keys up to
 * `len_max`: the next block asked for (blocks lie anywhere in the pool), this one's token rows of
 * the item's heads (`row_len` elements from `first`) as float32. Sets how many rows it holds
 * (at most a block, at most the keys left) and their stride. */
#define DEFINE_BLOCK_AT(SUFFIX, T)                                                                 \
    static inline const float* block_at_##SUFFIX(                                                 \
        const T* cache, const int32_t* table, int64_t b, int64_t num_blocks, int64_t len_max,     \
        int64_t block_size, int64_t token_stride, int64_t first, int64_t row_len, float* buffer,  \
        int64_t* filled, int64_t* stride) {                                                       \
        const int64_t block_stride = block_size * token_stride;                                   \
        const int64_t left = len_max - b * block_size;                                            \
        *filled = left < block_size ? left : block_size;                                          \
        if (b + 1 < num_blocks)                                                                   \
            prefetch_rows(cache + (int64_t)table[b + 1] * block_stride + first, block_size,       \
                          token_stride, row_len * (int64_t)sizeof(T));                            \
        return block_rows_##SUFFIX(buffer, cache + (int64_t)table[b] * block_stride + first,      \
                                   *filled, token_stride, row_len, stride);                       \
    }
#define WALK_ARGS block_size, token_stride, first, nkv * head_dim, buffer

/* A tile's query vector i is entry i / nh's query head kv_begin * G + i % nh; an entry is
 * (query row, keys it sees, block_tables row). */
#define ENTRY_ROW(e) entries[3 * (e)]
#define ENTRY_LEN(e) entries[3 * (e) + 1]
#define ENTRY_TABLE(e) entries[3 * (e) + 2]

/* Scores of the query vectors of entries [e0, e1) against block b's `filled` keys (token rows
 * of k0, `stride` apart): for each key a dot product of W-lane partial sums, lanes summed by
 * sum_lanes_each. A group of W keys past the block's end reads zeros; each key's lane is its
 * own, so what the other lanes hold changes none of its bits. */
static inline __attribute__((always_inline)) void score_block(
    float* scores, int64_t score_stride, const float* qs, const float* k0, int64_t stride,
    int64_t filled, int64_t b, int64_t block_size, int64_t e0, int64_t e1, int64_t nkv,
    int64_t group, const int64_t head_dim, const float* zeros) {
    const int64_t nh = nkv * group, vecs = head_dim / W;
    for (int64_t p0 = 0; p0 < filled; p0 += W) /* W token rows, all their heads */
        for (int64_t kv = 0; kv < nkv; ++kv) {
            const float* k[W];
            for (int t = 0; t < W; ++t)
                k[t] = p0 + t < filled ? k0 + (p0 + t) * stride + kv * head_dim : zeros;
            for (int64_t e = e0; e < e1; ++e)
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = e * nh + kv * group + g;
                    const float* q = qs + i * head_dim;
                    vf dots[W]; /* lane l of dots[t]: a chain over lanes j * W + l */
                    const vf q0 = load_lanes(q);
                    for (int t = 0; t < W; ++t) dots[t] = q0 * load_lanes(k[t]);
                    for (int64_t j = 1; j < vecs; ++j) {
                        const vf qj = load_lanes(q + j * W);
                        for (int t = 0; t < W; ++t) dots[t] += qj * load_lanes(k[t] + j * W);
                    }
                    store_lanes(scores + i * score_stride + b * block_size + p0,
                                sum_lanes_each(dots));
                }
        }
}

/* Each query vector of entries [e0, e1) adds block b's values, weighted by its softmax
 * numerators, to its accumulators: one chain per output lane over the entry's keys in order. */
static inline __attribute__((always_inline)) void value_block(
    float* acc, const float* scores, int64_t score_stride, const float* v0, int64_t stride,
    int64_t filled, int64_t b, int64_t block_size, const int64_t* entries, int64_t e0,
    int64_t e1, int64_t nh, int64_t group, const int64_t head_dim) {
    const int64_t vecs = head_dim / W;
    for (int64_t i = e0 * nh; i < e1 * nh; ++i) {
        const int64_t keys = ENTRY_LEN(i / nh) - b * block_size;
        if (keys <= 0) continue;
        const int64_t take = keys < filled ? keys : filled;
        const float* w = scores + i * score_stride + b * block_size;
        const float* v = v0 + (i % nh) / group * head_dim;
        float* a = acc + i * head_dim;
        int64_t j = 0; /* 8 chains at once where head_dim allows: FMA latency */
        for (; j + 8 <= vecs; j += 8) weighted_sum_8(a + j * W, w, v + j * W, stride, take);
        for (; j + 4 <= vecs; j += 4) weighted_sum_4(a + j * W, w, v + j * W, stride, take);
        for (; j < vecs; ++j) weighted_sum_1(a + j * W, w, v + j * W, stride, take);
    }
}

/* A tile's walk over `cache` (K or V), in key order for every entry: its shared blocks, by the
 * longest entry's table, for all its entries, then each entry's own blocks, from its own table,
 * for that entry alone. BLOCK(rows, b, e0, e1) handles block b's token rows for entries
 * [e0, e1); `filled` and `stride` say how many rows and how far apart. */
#define WALK_TILE(SUFFIX, cache, BLOCK)                                                            \
    do {                                                                                           \
        for (int64_t b = 0; b < shared; ++b) {                                                     \
            /* (read first: the block's `filled` and `stride` are set by reading it) */            \
            const float* rows_ = block_at_##SUFFIX(cache, shared_table, b, shared, len_max,        \
                                                   WALK_ARGS, &filled, &stride);                   \
            BLOCK(rows_, b, 0, count);                                                             \
        }                                                                                          \
        for (int64_t e = 0; e < count; ++e) {                                                      \
            const int32_t* table = block_tables + ENTRY_TABLE(e) * block_table_stride;             \
            const int64_t len = ENTRY_LEN(e), num_blocks = (len + block_size - 1) / block_size;    \
            for (int64_t b = shared; b < num_blocks; ++b) {                                        \
                const float* rows_ = block_at_##SUFFIX(cache, table, b, num_blocks, len,           \
                                                       WALK_ARGS, &filled, &stride);               \
                BLOCK(rows_, b, e, e + 1);                                                         \
            }                                                                                      \
        }                                                                                          \
    } while (0)
#define SCORE_BLOCK(rows, b, e0, e1)                                                               \
    score_block(scores, score_stride, qs, rows, stride, filled, b, block_size, e0, e1, nkv, group, \
                head_dim, zeros)
#define VALUE_BLOCK(rows, b, e0, e1)                                                               \
    value_block(acc, scores, score_stride, rows, stride, filled, b, block_size, entries, e0, e1,   \
                nh, group, head_dim)

/* One tile: `count` entries and the query heads of KV heads [kv_begin, kv_end). Its first
 * `shared` blocks are the same blocks in every entry's table (a prefix the sequences share, or
 * one sequence's rows): each is read once for all entries and heads. Each entry then reads the
 * rest of its context from its own table. Every (row, key) pair's score, softmax and weighted
 * sum is the same sequence of operations either way, in the same key order. */
#define DEFINE_ATTEND_TILE(SUFFIX, T)                                                              \
    static inline __attribute__((always_inline)) void attend_tile_##SUFFIX(                       \
        const T* query, int64_t query_stride, const T* key_cache, const T* value_cache,           \
        const int32_t* block_tables, int64_t block_table_stride, const int64_t* entries,          \
        int64_t count, int64_t shared, int64_t num_heads, int64_t num_kv_heads, int64_t kv_begin, \
        int64_t kv_end, const int64_t head_dim, int64_t block_size, int64_t score_stride,         \
        float scale, T* out, int64_t out_stride, float* scratch) {                                \
        const int64_t group = num_heads / num_kv_heads;                                           \
        const int64_t nkv = kv_end - kv_begin, nh = nkv * group, n = count * nh;                  \
        const int64_t token_stride = num_kv_heads * head_dim;                                     \
        const int64_t first = kv_begin * head_dim; /* the item's first element of a token row */ \
        int64_t longest = 0; /* the shared blocks are read by its table: they lie within it */    \
        for (int64_t e = 1; e < count; ++e)                                                       \
            longest = ENTRY_LEN(e) > ENTRY_LEN(longest) ? e : longest;                            \
        const int64_t len_max = ENTRY_LEN(longest);                                               \
        const int32_t* shared_table = block_tables + ENTRY_TABLE(longest) * block_table_stride;   \
        float* scores = scratch;                                                                  \
        float* qs = scores + n * score_stride;                                                    \
        float* acc = qs + n * head_dim;                                                           \
        float* buffer = acc + n * head_dim;                                                       \
        float* zeros = buffer + block_size * token_stride;                                        \
        float* inv = zeros + head_dim; /* [n]: 1 / each softmax's sum */                          \
        memset(zeros, 0, sizeof(float) * head_dim);                                               \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            const T* q = query + ENTRY_ROW(i / nh) * query_stride + first * group +               \
                         (i % nh) * head_dim;                                                     \
            for (int64_t d = 0; d < head_dim; ++d)                                                \
                qs[i * head_dim + d] = load_##SUFFIX(q[d]) * scale;                               \
        }                                                                                         \
        int64_t filled, stride;                                                                   \
        WALK_TILE(SUFFIX, key_cache, SCORE_BLOCK);                                                \
        for (int64_t i = 0; i < n; ++i)                                                           \
            inv[i] = 1.f / softmax_numerators(scores + i * score_stride, ENTRY_LEN(i / nh));      \
        memset(acc, 0, sizeof(float) * n * head_dim);                                             \
        WALK_TILE(SUFFIX, value_cache, VALUE_BLOCK);                                              \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            T* o = out + ENTRY_ROW(i / nh) * out_stride + first * group + (i % nh) * head_dim;    \
            for (int64_t d = 0; d < head_dim; ++d)                                                \
                store_##SUFFIX(o + d, acc[i * head_dim + d] * inv[i]);                            \
        }                                                                                         \
    }

/* Return codes (as paged_decode_*'s). */
#define PAGED_ROWS_OK 0
#define PAGED_ROWS_NO_MEMORY -1 /* a thread could not allocate its scratch */
/* a tile of no entries or over max_tile_rows, an entry seeing no keys or over max_seq_len, more
 * shared blocks than its longest entry's */
#define PAGED_ROWS_BAD_LENGTH -2
#define PAGED_ROWS_BAD_SHAPE -3 /* head_dim not a multiple of W */
/* a tile naming entries past `num_entries`, an entry naming a query row or a block_tables row
 * that is not there, or entries whose tables differ in a block their tile reads as shared */
#define PAGED_ROWS_BAD_INDEX -4

/* PAGED_ROWS_OK if tile (first entry, entries, shared blocks) is one the kernel can read, else
 * why not: every row and table it names is there, and the blocks it reads once are the same
 * blocks in each entry's table, as far as the entry's keys go (past them an entry reads none). */
static int tile_fits(const int64_t* tile, const int64_t* all_entries, int64_t num_entries,
                     int64_t num_rows, const int32_t* block_tables, int64_t num_tables,
                     int64_t block_table_stride, int64_t max_tile_rows, int64_t max_seq_len,
                     int64_t block_size) {
    if (tile[0] < 0 || tile[1] < 1 || tile[1] > num_entries - tile[0]) return PAGED_ROWS_BAD_INDEX;
    if (tile[1] > max_tile_rows || tile[2] < 0) return PAGED_ROWS_BAD_LENGTH;
    const int64_t* entries = all_entries + 3 * tile[0];
    int64_t longest = 0;
    for (int64_t e = 0; e < tile[1]; ++e) {
        if (ENTRY_ROW(e) < 0 || ENTRY_ROW(e) >= num_rows || ENTRY_TABLE(e) < 0 ||
            ENTRY_TABLE(e) >= num_tables)
            return PAGED_ROWS_BAD_INDEX;
        if (ENTRY_LEN(e) < 1 || ENTRY_LEN(e) > max_seq_len) return PAGED_ROWS_BAD_LENGTH;
        longest = ENTRY_LEN(e) > ENTRY_LEN(longest) ? e : longest;
    }
    if (tile[2] > (ENTRY_LEN(longest) + block_size - 1) / block_size) return PAGED_ROWS_BAD_LENGTH;
    const int32_t* shared = block_tables + ENTRY_TABLE(longest) * block_table_stride;
    for (int64_t e = 0; e < tile[1]; ++e) {
        if (ENTRY_TABLE(e) == ENTRY_TABLE(longest)) continue;
        const int32_t* own = block_tables + ENTRY_TABLE(e) * block_table_stride;
        const int64_t own_blocks = (ENTRY_LEN(e) + block_size - 1) / block_size;
        for (int64_t b = 0; b < tile[2] && b < own_blocks; ++b)
            if (own[b] != shared[b]) return PAGED_ROWS_BAD_INDEX;
    }
    return PAGED_ROWS_OK;
}

#define TILE_ARGS(HEAD_DIM)                                                                        \
    query, query_stride, key_cache, value_cache, block_tables, block_table_stride,               \
        entries + 3 * tile[0], tile[1], tile[2], num_heads, num_kv_heads, kv_begin,               \
        kv_begin + kv_per_item, (HEAD_DIM), block_size, score_stride, scale, out, out_stride,     \
        scratch

/* Tiles, or with fewer than two a thread, (tile, KV head) pairs, in parallel. A tile is (its
 * first entry in `entries`, how many, blocks they share); entries [num_entries, 3] are (query row,
 * keys it sees, block_tables row), checked against the `num_rows` rows of query and out and the
 * `num_tables` rows of block_tables. */
#define DEFINE_PAGED_ROWS(SUFFIX, T)                                                               \
    int paged_rows_##SUFFIX(const T* query, int64_t query_stride, const T* key_cache,             \
                            const T* value_cache, const int32_t* block_tables,                    \
                            int64_t block_table_stride, int64_t num_rows, int64_t num_tables,     \
                            const int64_t* entries, int64_t num_entries, const int64_t* tiles,    \
                            int64_t num_tiles, int64_t max_tile_rows,                             \
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,            \
                            int64_t block_size, int64_t max_seq_len, float scale, T* out,         \
                            int64_t out_stride, int64_t num_threads) {                            \
        if (head_dim % W != 0) return PAGED_ROWS_BAD_SHAPE;                                       \
        int status = PAGED_ROWS_OK;                                                               \
        const int64_t score_stride = ROWS_SCORE_STRIDE(max_seq_len);                              \
        const int64_t splits = num_tiles >= 2 * num_threads ? 1 : num_kv_heads;                   \
        const int64_t kv_per_item = num_kv_heads / splits;                                        \
        const size_t scratch_floats = (size_t)ROWS_SCRATCH_FLOATS(                                \
            max_tile_rows * kv_per_item * (num_heads / num_kv_heads), head_dim, block_size,       \
            num_kv_heads * head_dim, score_stride);                                               \
        (void)num_threads; /* without OpenMP: one thread */                                       \
        PRAGMA(omp parallel for schedule(dynamic, 1) num_threads(num_threads))                    \
        for (int64_t item = 0; item < num_tiles * splits; ++item) {                               \
            const int64_t* tile = tiles + 3 * (item / splits);                                    \
            const int64_t kv_begin = (item % splits) * kv_per_item;                               \
            float* scratch = rows_scratch_for(scratch_floats);                                    \
            const int fits = tile_fits(tile, entries, num_entries, num_rows, block_tables,        \
                                       num_tables, block_table_stride, max_tile_rows,             \
                                       max_seq_len, block_size);                                  \
            if (scratch == NULL || fits != PAGED_ROWS_OK) {                                       \
                PRAGMA(omp atomic write)                                                          \
                status = scratch == NULL ? PAGED_ROWS_NO_MEMORY : fits;                           \
                continue;                                                                         \
            }                                                                                     \
            switch (head_dim) {                                                                   \
                case 64: attend_tile_##SUFFIX(TILE_ARGS(64)); break;                              \
                case 128: attend_tile_##SUFFIX(TILE_ARGS(128)); break;                            \
                default: attend_tile_##SUFFIX(TILE_ARGS(head_dim));                               \
            }                                                                                     \
        }                                                                                         \
        return status;                                                                            \
    }

DEFINE_BLOCK_AT(f32, float)
DEFINE_BLOCK_AT(bf16, uint16_t)
DEFINE_ATTEND_TILE(f32, float)
DEFINE_ATTEND_TILE(bf16, uint16_t)
DEFINE_PAGED_ROWS(f32, float)
DEFINE_PAGED_ROWS(bf16, uint16_t)

/* The vector width head_dim must be a multiple of. */
int paged_rows_lanes(void) { return W; }
