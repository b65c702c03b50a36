/* Batch-invariant paged attention for the CPU: every query's output is a function of its own query, its
 * position and the keys/values it sees, computed by the same instructions in the same order whatever else
 * is in the pass (how many queries, which sequences, their lengths, how the work is split over threads).
 *
 * Layout (as kernels/paged_attention.py): q and out [tokens, heads, d] float32; k_pool and v_pool
 * [kv_heads, slots, d] float32 or bfloat16 (head stride given, slots contiguous rows of d); block_tables
 * int32 [seqs, max_blocks]; token t belongs to sequence tok_seq[t] and sits at position tok_pos[t]; it sees
 * keys at positions <= its own and, with a window w > 0, > pos - w.
 *
 * Token trees (tree_start non-NULL): from position tree_start[t] on, token t reads its keys from the pool rows
 * tree_slots[tree_off[t] + (p - tree_start[t])] (its ancestors, then itself) instead of the block table: a tree's
 * node attends as the last token of a chain would, over the same keys in the same order (the same bits).
 *
 * A query's visible keys are cut at fixed absolute positions into chunks of `chunk` keys. Phase 1: one work
 * item per (sequence, kv head, chunk, 8 of the sequence's tokens) computes, for each of those queries (and each
 * query head of the kv head) that sees the chunk, the chunk's partial softmax: m = max score, l = sum exp(s - m),
 * o = sum exp(s - m) v, keys in position order. The item reads the chunk's keys, then its values, in tiles of 32
 * that each of its queries uses while the tile is in the L1 cache. (16 tree nodes over a 300-key history on 2
 * threads of an AMD EPYC: 129 us, against 178 us for one item per chunk whose queries each read all its keys.)
 * Phase 2: one item per (token, head) merges its chunks in
 * order: M = max m_c, out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c. Nothing in either phase reads
 * another query's numbers, so the result cannot depend on the batch. Vector code is lane-independent
 * (each key's score and exp come out the same in any lane); reductions are sequential in a fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* W lanes per vector: 16 where the CPU has 512-bit registers, else 8 (a 16-lane vector's shuffles would go
 * through memory on AVX2: measured 3x slower). The sums' trees follow W, so results are the same bits for any
 * batch on one machine; an AVX-512 machine and an AVX2 one may differ in the last bits. */
#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

static inline vf splat(float x) { vf v = {0}; return v + x; }
static inline vf loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf loadh(const uint16_t *p) {
    vh h; memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f; memcpy(&f, &u, sizeof f); return f;
}
static inline float tof(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) for x <= 0 (Cephes' expf polynomial), the same operations in every lane. */
static inline vf vexp(vf x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    vf n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f); /* round */
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf y = splat(1.9875691500E-4f);
    y = y * r + splat(1.3981999507E-3f);
    y = y * r + splat(8.3334519073E-3f);
    y = y * r + splat(4.1665795894E-2f);
    y = y * r + splat(1.6666665459E-1f);
    y = y * r + splat(5.0000001201E-1f);
    y = y * r * r + r + splat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

typedef struct {
    const float *q; const void *k; const void *v; int bf16; int64_t head_stride;
    const int32_t *tables; int max_blocks; const int32_t *tok_seq; const int32_t *tok_pos;
    const int32_t *seq_tok0; const int32_t *seq_ntok;  /* each sequence's tokens: [tok0, tok0 + ntok) */
    int seqs, heads, kv_heads, d, block_size, window, chunk, max_chunks;
    float scale;
    float *partials;  /* [tokens, heads, max_chunks, d + 2]: m, l, o (chunk index relative to the first seen) */
    float *out;
    const int32_t *tree_start, *tree_off, *tree_slots;  /* token trees, or NULL */
    /* work items */
    int64_t num_items; void *items; int phase; int64_t next; int failed;
} job_t;

static inline int first_visible(const job_t *J, int pos) { return J->window > 0 && pos + 1 > J->window ? pos + 1 - J->window : 0; }

#if W == 8
/* Sum of the 8 lanes by a fixed tree (the same order for every key). */
static inline float hsum(vf v) {
    const vi h4 = {4, 5, 6, 7, 0, 1, 2, 3};
    const vi h2 = {2, 3, 0, 1, 6, 7, 4, 5};
    const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6};
    v += __builtin_shuffle(v, h4);
    v += __builtin_shuffle(v, h2);
    v += __builtin_shuffle(v, h1);
    return v[0];
}

/* The 8-lane sums of four vectors at once: the same tree as hsum for each (so the same bits as hsum). */
static inline vf hsum4(vf a0, vf a1, vf a2, vf a3) {
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11};
    const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi lo2 = {0, 1, 8, 9, 4, 5, 12, 13};
    const vi hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6};
    vf p = __builtin_shuffle(a0, a1, lo4) + __builtin_shuffle(a0, a1, hi4);  /* a0 in 0-3, a1 in 4-7 */
    vf q = __builtin_shuffle(a2, a3, lo4) + __builtin_shuffle(a2, a3, hi4);  /* a2 in 0-3, a3 in 4-7 */
    vf r = __builtin_shuffle(p, q, lo2) + __builtin_shuffle(p, q, hi2);      /* a0 0-1, a2 2-3, a1 4-5, a3 6-7 */
    r += __builtin_shuffle(r, h1);
    return r;  /* lane 0: a0, 2: a2, 4: a1, 6: a3 */
}
#define LANE_A1 4
#define LANE_A2 2
#define LANE_A3 6
#else
/* Sum of the 16 lanes by a fixed tree (the same order for every key). */
static inline float hsum(vf v) {
    const vi h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v += __builtin_shuffle(v, h8);
    v += __builtin_shuffle(v, h4);
    v += __builtin_shuffle(v, h2);
    v += __builtin_shuffle(v, h1);
    return v[0];
}

/* The 16-lane sums of four vectors at once: the same tree as hsum for each (so the same bits as hsum). */
static inline vf hsum4(vf a0, vf a1, vf a2, vf a3) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    vf p = __builtin_shuffle(a0, a1, lo8) + __builtin_shuffle(a0, a1, hi8);  /* a0 in 0-7, a1 in 8-15 */
    vf q = __builtin_shuffle(a2, a3, lo8) + __builtin_shuffle(a2, a3, hi8);  /* a2 in 0-7, a3 in 8-15 */
    vf r = __builtin_shuffle(p, q, lo4) + __builtin_shuffle(p, q, hi4);      /* a0 0-3, a2 4-7, a1 8-11, a3 12-15 */
    r += __builtin_shuffle(r, h2);
    r += __builtin_shuffle(r, h1);
    return r;  /* lane 0: a0, 4: a2, 8: a1, 12: a3 */
}
#define LANE_A1 8
#define LANE_A2 4
#define LANE_A3 12
#endif

/* scores[j] = scale * q . k_j for the keys [a, b) (rows of k, contiguous, d apart): lanes over the head dims,
 * summed by the fixed tree of hsum, so each key's score is the same bits whatever its neighbours. */
static inline __attribute__((always_inline)) void score(float *scores, const float *q, const float *k, int a, int b,
                                                         int d, float scale, const int D) {
    const int dd = D ? D : d;
    int j = a;
    if (D) {
        vf qv[D / W];
        for (int v = 0; v < D / W; ++v) qv[v] = loadf(q + v * W);
        for (; j + 4 <= b; j += 4) {
            vf acc[4];
            for (int u = 0; u < 4; ++u) {
                const float *kj = k + (int64_t)(j + u) * D;
                acc[u] = splat(0.0f);
                for (int v = 0; v < D / W; ++v) acc[u] += qv[v] * loadf(kj + v * W);
            }
            vf s = hsum4(acc[0], acc[1], acc[2], acc[3]);
            scores[j] = s[0] * scale;
            scores[j + 1] = s[LANE_A1] * scale;
            scores[j + 2] = s[LANE_A2] * scale;
            scores[j + 3] = s[LANE_A3] * scale;
        }
    }
    for (; j < b; ++j) {
        const float *kj = k + (int64_t)j * dd;
        vf acc = splat(0.0f);
        int i = 0;
        for (; i + W <= dd; i += W) acc += loadf(q + i) * loadf(kj + i);
        float s = hsum(acc);
        for (; i < dd; ++i) s += q[i] * kj[i];
        scores[j] = s * scale;
    }
}

/* Adds the keys [a, b) (weights e[j], rows of v contiguous, d apart) to a query's weighted sum held in memory:
 * acc[0:d] and l[0] the keys at even offsets from its first key, acc[d:2d] and l[1] those at odd offsets (`odd`:
 * whether a is at an odd offset). Each of the two sums runs key after key in position order, so splitting a
 * query's keys over several calls (tiles) gives the same bits as one call; the two are added when it ends.
 * D == 0 (any d): one sum, acc[0:d] and l[0], key after key. */
static inline __attribute__((always_inline)) void weighted_sum(float *acc, float *l, const float *e, const float *v,
                                                                int a, int b, int odd, int d, const int D) {
    if (a >= b) return;
    if (D) {
        vf acc0[D / W], acc1[D / W];
        for (int u = 0; u < D / W; ++u) acc0[u] = loadf(acc + u * W), acc1[u] = loadf(acc + D + u * W);
        float l0 = l[0], l1 = l[1];
        int j = a;
        if (odd) {
            const vf e1 = splat(e[j]);
            for (int u = 0; u < D / W; ++u) acc1[u] += e1 * loadf(v + (int64_t)j * D + u * W);
            l1 += e[j++];
        }
        for (; j + 2 <= b; j += 2) {
            const vf e0 = splat(e[j]), e1 = splat(e[j + 1]);
            const float *r0 = v + (int64_t)j * D, *r1 = r0 + D;
            for (int u = 0; u < D / W; ++u) acc0[u] += e0 * loadf(r0 + u * W);
            for (int u = 0; u < D / W; ++u) acc1[u] += e1 * loadf(r1 + u * W);
            l0 += e[j];
            l1 += e[j + 1];
        }
        if (j < b) {
            const vf e0 = splat(e[j]);
            for (int u = 0; u < D / W; ++u) acc0[u] += e0 * loadf(v + (int64_t)j * D + u * W);
            l0 += e[j];
        }
        for (int u = 0; u < D / W; ++u) storef(acc + u * W, acc0[u]), storef(acc + D + u * W, acc1[u]);
        l[0] = l0, l[1] = l1;
        return;
    }
    for (int j = a; j < b; ++j) {
        const float *row = v + (int64_t)j * d;
        int i = 0;
        for (; i + W <= d; i += W) storef(acc + i, loadf(acc + i) + splat(e[j]) * loadf(row + i));
        for (; i < d; ++i) acc[i] += e[j] * row[i];
        l[0] += e[j];
    }
}

/* max of x[a, b): exact in any order, so by whole vectors. */
static inline float max_of(const float *x, int a, int b) {
    float m = x[a];
    int j = a;
    if (b - a >= W) {
        vf mv = loadf(x + a);
        for (j = a + W; j + W <= b; j += W) {
            vf y = loadf(x + j);
            mv = vselect(y > mv, y, mv);
        }
        for (int l = 0; l < W; ++l) m = mv[l] > m ? mv[l] : m;
    }
    for (; j < b; ++j) m = x[j] > m ? x[j] : m;
    return m;
}

/* n rows of the pool, rows slots[0..n), copied contiguous as float32 (bfloat16 widened). */
static void gather(float *dst, const char *base, const int64_t *slots, int n, int d, int bf16) {
    for (int j = 0; j < n; ++j) {
        float *out = dst + (int64_t)j * d;
        int i = 0;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)base + slots[j] * d;
            for (; i + W <= d; i += W) storef(out + i, loadh(src + i));
            for (; i < d; ++i) out[i] = tof(src[i]);
        } else {
            memcpy(out, (const float *)base + slots[j] * d, sizeof(float) * d);
        }
    }
}

#define BY_HEAD_SIZE(fn, d, ...) \
    (d == 64 ? fn(__VA_ARGS__, 64) : d == 128 ? fn(__VA_ARGS__, 128) : d == 256 ? fn(__VA_ARGS__, 256) : fn(__VA_ARGS__, 0))

/* Work items of phase 1: sequence s, kv head g, chunk c, its tokens [blk * ITEM_TOKENS, +ITEM_TOKENS); phase 2:
 * token s, head g. */
typedef struct { int32_t s, g, c, blk; } item_t;
#define ITEM_TOKENS 8  /* a long tree or prefill is split into items of 8 tokens, so every thread gets work */
#define TILE 32        /* keys per tile: a tile's keys (then values) stay in the L1 cache for every query of the item */

/* Per-thread scratch of phase 1 (sizes in scratch_floats). */
typedef struct { float *scores, *acc, *m, *tile, *path; int64_t *slots, *path_slots; } bufs_t;

static size_t scratch_floats(const job_t *J) {
    const size_t rows = (size_t)ITEM_TOKENS * (J->heads / J->kv_heads), S = (size_t)J->chunk + W;
    return rows * S + rows * (2 * (size_t)J->d + 2) + rows + 4 * S + (size_t)TILE * J->d + (size_t)J->chunk * J->d;
}

static bufs_t carve(const job_t *J, float *base) {
    const size_t rows = (size_t)ITEM_TOKENS * (J->heads / J->kv_heads), S = (size_t)J->chunk + W;
    bufs_t B;
    B.scores = base;                          /* [rows, S]: each query's scores, then weights */
    B.acc = B.scores + rows * S;              /* [rows, 2d + 2]: its two weighted sums, then their weights' sums */
    B.m = B.acc + rows * (2 * J->d + 2);      /* [rows]: its max score */
    B.slots = (int64_t *)(B.m + rows);        /* [S]: the pool row of each key of the chunk */
    B.path_slots = B.slots + S;               /* [S]: the pool rows of a tree node's path */
    B.tile = (float *)(B.path_slots + S);     /* [TILE, d]: one tile's keys or values */
    B.path = B.tile + (size_t)TILE * J->d;    /* [chunk, d]: a tree node's path's keys or values */
    return B;
}

/* The pool rows of tree token t's own keys at chunk offsets [from, to) (its path: ancestors, then itself). */
static inline void path_rows(const job_t *J, int t, int c0, int from, int to, int64_t *rows) {
    const int64_t at = (int64_t)J->tree_off[t] + c0 - J->tree_start[t];  /* + j: offset j's entry */
    for (int j = from; j < to; ++j) rows[j - from] = J->tree_slots[at + j];
}

/* Phase 1, one item: sequence s, kv head g, chunk c, tokens t0..t1 (and every query head of g). Each query's keys
 * in the chunk are [a, b): [a, e) read through the block table, tile by tile (each tile copied once, read by every
 * query while it is in cache), and, for a tree's node, [e, b) through its path. Scores first, then their
 * max and exp, then the weighted sums, each query's keys in position order. */
static void chunk_item(const job_t *J, const item_t *it, bufs_t B) {
    const int d = J->d, bs = J->block_size, group = J->heads / J->kv_heads, bf16 = J->bf16, C = J->chunk;
    const int S = C + W, s = it->s, g = it->g, c = it->c, c0 = c * C, D2 = 2 * d + 2;
    const int32_t *table = J->tables + (int64_t)s * J->max_blocks;
    const size_t esz = bf16 ? 2 : 4;
    const char *kb = (const char *)J->k + (size_t)g * J->head_stride * esz;
    const char *vb = (const char *)J->v + (size_t)g * J->head_stride * esz;
    const int tend = J->seq_tok0[s] + J->seq_ntok[s], t0 = J->seq_tok0[s] + it->blk * ITEM_TOKENS;
    const int n = t0 + ITEM_TOKENS < tend ? ITEM_TOKENS : tend - t0;
    int a[ITEM_TOKENS], e[ITEM_TOKENS], b[ITEM_TOKENS], amin = C, emax = 0, any = 0;
    for (int i = 0; i < n; ++i) {
        const int t = t0 + i, pos = J->tok_pos[t], lo = first_visible(J, pos);
        a[i] = (c0 > lo ? c0 : lo) - c0;
        b[i] = (c0 + C < pos + 1 ? c0 + C : pos + 1) - c0;
        if (a[i] >= b[i]) { a[i] = b[i] = e[i] = 0; continue; }
        any = 1;
        e[i] = b[i];
        if (J->tree_start && c0 + b[i] > J->tree_start[t]) {  /* a tree's node: its own keys from the tree's start */
            const int ts = J->tree_start[t];
            e[i] = (c0 + a[i] > ts ? c0 + a[i] : ts) - c0;
        }
        if (a[i] < e[i]) {
            amin = a[i] < amin ? a[i] : amin;
            emax = e[i] > emax ? e[i] : emax;
        }
    }
    if (!any) return;
    for (int j = amin; j < emax; ++j) B.slots[j] = (int64_t)table[(c0 + j) / bs] * bs + (c0 + j) % bs;
#define QUERY(i, h) (J->q + ((int64_t)(t0 + (i)) * J->heads + g * group + (h)) * d)
#define ROW(i, h) (B.scores + (int64_t)((i) * group + (h)) * S)
#define ACC(i, h) (B.acc + (int64_t)((i) * group + (h)) * D2)
    for (int j0 = amin; j0 < emax; j0 += TILE) {
        const int j1 = j0 + TILE < emax ? j0 + TILE : emax;
        gather(B.tile, kb, B.slots + j0, j1 - j0, d, bf16);
        for (int i = 0; i < n; ++i) {
            const int x = a[i] > j0 ? a[i] : j0, y = e[i] < j1 ? e[i] : j1;
            if (x >= y) continue;
            for (int h = 0; h < group; ++h)
                BY_HEAD_SIZE(score, d, ROW(i, h) + j0, QUERY(i, h), B.tile, x - j0, y - j0, d, J->scale);
        }
    }
    for (int i = 0; i < n; ++i) {
        if (e[i] >= b[i]) continue;
        path_rows(J, t0 + i, c0, e[i], b[i], B.path_slots);
        gather(B.path, kb, B.path_slots, b[i] - e[i], d, bf16);
        for (int h = 0; h < group; ++h)
            BY_HEAD_SIZE(score, d, ROW(i, h) + e[i], QUERY(i, h), B.path, 0, b[i] - e[i], d, J->scale);
    }
    for (int i = 0; i < n; ++i) {
        if (a[i] >= b[i]) continue;
        for (int h = 0; h < group; ++h) {
            float *row = ROW(i, h);
            const float m = max_of(row, a[i], b[i]);
            /* exp by whole vectors from a (the lanes past b are computed and never read) */
            for (int j = a[i]; j < b[i]; j += W) storef(row + j, vexp(loadf(row + j) - splat(m)));
            B.m[i * group + h] = m;
            memset(ACC(i, h), 0, sizeof(float) * D2);
        }
    }
    for (int j0 = amin; j0 < emax; j0 += TILE) {
        const int j1 = j0 + TILE < emax ? j0 + TILE : emax;
        gather(B.tile, vb, B.slots + j0, j1 - j0, d, bf16);
        for (int i = 0; i < n; ++i) {
            const int x = a[i] > j0 ? a[i] : j0, y = e[i] < j1 ? e[i] : j1;
            if (x >= y) continue;
            for (int h = 0; h < group; ++h) {
                float *acc = ACC(i, h);
                BY_HEAD_SIZE(weighted_sum, d, acc, acc + 2 * d, ROW(i, h) + j0, B.tile, x - j0, y - j0, (x - a[i]) & 1, d);
            }
        }
    }
    for (int i = 0; i < n; ++i) {
        if (e[i] >= b[i]) continue;
        path_rows(J, t0 + i, c0, e[i], b[i], B.path_slots);
        gather(B.path, vb, B.path_slots, b[i] - e[i], d, bf16);
        for (int h = 0; h < group; ++h) {
            float *acc = ACC(i, h);
            BY_HEAD_SIZE(weighted_sum, d, acc, acc + 2 * d, ROW(i, h) + e[i], B.path, 0, b[i] - e[i], (e[i] - a[i]) & 1, d);
        }
    }
    const int two_sums = d == 64 || d == 128 || d == 256;  /* weighted_sum's D > 0 */
    for (int i = 0; i < n; ++i) {
        if (a[i] >= b[i]) continue;
        const int t = t0 + i, c_rel = c - first_visible(J, J->tok_pos[t]) / C;
        for (int h = 0; h < group; ++h) {
            const float *acc = ACC(i, h);
            float *part = J->partials + (((int64_t)t * J->heads + g * group + h) * J->max_chunks + c_rel) * (d + 2);
            part[0] = B.m[i * group + h];
            part[1] = two_sums ? acc[2 * d] + acc[2 * d + 1] : acc[2 * d];
            for (int k = 0; k < d; ++k) part[2 + k] = two_sums ? acc[k] + acc[d + k] : acc[k];
        }
    }
#undef QUERY
#undef ROW
#undef ACC
}

/* Phase 2: token t, head h: merge its chunks in order. */
static void merge_item(const job_t *J, int t, int h) {
    const int d = J->d, pos = J->tok_pos[t];
    const int nc = pos / J->chunk - first_visible(J, pos) / J->chunk + 1;
    const float *part = J->partials + ((int64_t)t * J->heads + h) * J->max_chunks * (d + 2);
    float *out = J->out + ((int64_t)t * J->heads + h) * d;
    float m = part[0];
    for (int c = 1; c < nc; ++c) m = part[c * (d + 2)] > m ? part[c * (d + 2)] : m;
    float l = 0.0f;
    memset(out, 0, sizeof(float) * d);
    for (int c = 0; c < nc; ++c) {
        const float *pc = part + c * (d + 2);
        const float w = expf(pc[0] - m);
        l += w * pc[1];
        int i = 0;
        for (; i + W <= d; i += W) storef(out + i, loadf(out + i) + splat(w) * loadf(pc + 2 + i));
        for (; i < d; ++i) out[i] += w * pc[2 + i];
    }
    int i = 0;
    for (; i + W <= d; i += W) storef(out + i, loadf(out + i) / splat(l));
    for (; i < d; ++i) out[i] /= l;
}

/* Per-thread scratch, kept between calls (no allocation, no page faults per call). */
static __thread float *t_scratch;
static __thread size_t t_scratch_floats;

static float *scratch(size_t floats) {
    if (floats > t_scratch_floats) {
        free(t_scratch);
        t_scratch = aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
        t_scratch_floats = t_scratch ? floats : 0;
    }
    return t_scratch;
}

static void *worker(void *arg) {
    job_t *J = (job_t *)arg;
    float *base = J->phase == 1 ? scratch(scratch_floats(J)) : NULL;
    if (J->phase == 1 && !base) {
        __atomic_store_n(&J->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    const bufs_t B = J->phase == 1 ? carve(J, base) : (bufs_t){0};
    const item_t *items = (const item_t *)J->items;
    for (;;) {
        int64_t i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (i >= J->num_items) break;
        if (J->phase == 1) chunk_item(J, items + i, B);
        else merge_item(J, items[i].s, items[i].g);
    }
    return NULL;
}

/* The work items over `threads` threads of the OpenMP runtime torch has loaded (libgomp.so.1: the same
 * library, so the same pool of threads its own operators use and that waits, spinning, right after them). */
static void run(job_t *J, int threads) {
    J->next = 0;
    if (threads > J->num_items) threads = (int)J->num_items;
#pragma omp parallel num_threads(threads) if (threads > 1)
    worker(J);
}

/* The chunks some query of tokens [t0, t1) sees: [lo, hi]. */
static void chunk_range(const job_t *J, int t0, int t1, int *lo, int *hi) {
    *lo = 1 << 30;
    *hi = -1;
    for (int t = t0; t < t1; ++t) {
        const int a = first_visible(J, J->tok_pos[t]) / J->chunk, b = J->tok_pos[t] / J->chunk;
        *lo = a < *lo ? a : *lo;
        *hi = b > *hi ? b : *hi;
    }
}

/* Phase 1's items (into items, or only counted when it is NULL): the longest work first within a sequence. */
static int64_t chunk_items(const job_t *J, item_t *items) {
    int64_t n = 0;
    for (int s = 0; s < J->seqs; ++s) {
        const int tok0 = J->seq_tok0[s], ntok = J->seq_ntok[s];
        for (int blk = 0; blk * ITEM_TOKENS < ntok; ++blk) {
            const int t0 = tok0 + blk * ITEM_TOKENS, t1 = t0 + ITEM_TOKENS < tok0 + ntok ? t0 + ITEM_TOKENS : tok0 + ntok;
            int lo, hi;
            chunk_range(J, t0, t1, &lo, &hi);
            for (int c = hi; c >= lo; --c)
                for (int g = 0; g < J->kv_heads; ++g) {
                    if (items) items[n] = (item_t){s, g, c, blk};
                    ++n;
                }
        }
    }
    return n;
}

/* Returns 0, or -1 when out of memory. */
int paged_attention(const float *q, const void *k_pool, const void *v_pool, int bf16, int64_t head_stride,
                    const int32_t *tables, int max_blocks, const int32_t *tok_seq, const int32_t *tok_pos,
                    const int32_t *seq_tok0, const int32_t *seq_ntok, int tokens, int seqs, int heads,
                    int kv_heads, int d, int block_size, int window, int chunk, float scale, float *partials,
                    int max_chunks, float *out, int threads, const int32_t *tree_start, const int32_t *tree_off,
                    const int32_t *tree_slots) {
    job_t J = {q, k_pool, v_pool, bf16, head_stride, tables, max_blocks, tok_seq, tok_pos, seq_tok0, seq_ntok,
               seqs, heads, kv_heads, d, block_size, window, chunk, max_chunks, scale, partials, out,
               tree_start, tree_off, tree_slots, 0, NULL, 1, 0, 0};
    int64_t n = chunk_items(&J, NULL);
    int64_t cap = n > (int64_t)tokens * heads ? n : (int64_t)tokens * heads;
    item_t *items = malloc(sizeof(item_t) * (cap ? cap : 1));
    if (!items) return -1;
    J.items = (void *)items;
    J.num_items = chunk_items(&J, items);
    int64_t work = 0;  /* key-rows: worth a second thread past ~8k of them */
    for (int t = 0; t < tokens; ++t) work += (int64_t)(tok_pos[t] + 1 - first_visible(&J, tok_pos[t])) * heads;
    if (work < 8192) threads = 1;
    run(&J, threads);
    n = 0;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h) items[n++] = (item_t){t, h, 0, 0};
    J.num_items = n;
    J.phase = 2;
    run(&J, threads);
    free(items);
    return J.failed ? -1 : 0;
}
