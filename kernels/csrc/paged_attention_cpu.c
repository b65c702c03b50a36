/* Batch-invariant paged attention for the CPU: every query's output is a function of its own query, its
 * position and the keys/values it sees, computed by the same instructions in the same order whatever else
 * is in the pass (how many queries, which sequences, their lengths, how the work is split over threads).
 *
 * Layout (as kernels/paged_attention.py): q and out [tokens, heads, d] float32; k_pool and v_pool
 * [kv_heads, slots, d] float32 or bfloat16 (head stride given, slots contiguous rows of d); block_tables
 * int32 [seqs, max_blocks]; token t belongs to sequence tok_seq[t] and sits at position tok_pos[t]; it sees
 * keys at positions <= its own and, with a window w > 0, > pos - w.
 *
 * A query's visible keys are cut at fixed absolute positions into chunks of `chunk` keys. Phase 1: one work
 * item per (sequence, kv head, chunk) computes, for each of that sequence's queries (and each query head of
 * the kv head) that sees the chunk, the chunk's partial softmax: m = max score, l = sum exp(s - m),
 * o = sum exp(s - m) v, keys in position order. Phase 2: one item per (token, head) merges its chunks in
 * order: M = max m_c, out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c. Nothing in either phase reads
 * another query's numbers, so the result cannot depend on the batch. Vector code is lane-independent
 * (each key's score and exp come out the same in any lane); reductions are sequential in a fixed order.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

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
    /* work items */
    int64_t num_items; int64_t *items; int phase; int64_t next;
} job_t;

static inline int first_visible(const job_t *J, int pos) { return J->window > 0 && pos + 1 > J->window ? pos + 1 - J->window : 0; }

static inline void axpy(float *o, float e, const void *vbase, int64_t row, int d, int bf16) {
    int i = 0;
    vf ev = splat(e);
    if (bf16) {
        const uint16_t *v = (const uint16_t *)vbase + row * d;
        for (; i + W <= d; i += W) storef(o + i, loadf(o + i) + ev * loadh(v + i));
        for (; i < d; ++i) o[i] += e * tof(v[i]);
    } else {
        const float *v = (const float *)vbase + row * d;
        for (; i + W <= d; i += W) storef(o + i, loadf(o + i) + ev * loadf(v + i));
        for (; i < d; ++i) o[i] += e * v[i];
    }
}

/* o[0:d] += e * v[0:d] for the rows [a, b) of the chunk, keys in order. D > 0: the head size known at
 * compile time (o held in registers); D == 0: any d. */
static inline __attribute__((always_inline)) void weighted_sum(float *o, const float *e, const char *vb,
                                                                const int64_t *slots, int a, int b, int d, int bf16, const int D) {
    if (D) {
        vf acc[D / W];
        for (int v = 0; v < D / W; ++v) acc[v] = splat(0.0f);
        for (int j = a; j < b; ++j) {
            const vf ev = splat(e[j]);
            if (bf16) {
                const uint16_t *row = (const uint16_t *)vb + slots[j] * D;
                for (int v = 0; v < D / W; ++v) acc[v] += ev * loadh(row + v * W);
            } else {
                const float *row = (const float *)vb + slots[j] * D;
                for (int v = 0; v < D / W; ++v) acc[v] += ev * loadf(row + v * W);
            }
        }
        for (int v = 0; v < D / W; ++v) storef(o + v * W, acc[v]);
        return;
    }
    memset(o, 0, sizeof(float) * d);
    for (int j = a; j < b; ++j) axpy(o, e[j], vb, slots[j], d, bf16);
}

/* Phase 1: sequence s, kv head g, chunk c: every query of s that sees keys of the chunk. The chunk's keys are
 * first laid out transposed in blocks of 16 keys (kt[(j / 16) * d + i][j % 16]: dim i of key c0 + j), so a
 * query's scores for 16 keys are one vector accumulated over the head dims in a fixed order, each lane one
 * key: the same operations for a key in any lane. */
static void chunk_item(const job_t *J, int s, int g, int c, float *scores, int64_t *slots, float *kt) {
    const int d = J->d, bs = J->block_size, group = J->heads / J->kv_heads, bf16 = J->bf16, C = J->chunk;
    const int c0 = c * C;
    const int32_t *table = J->tables + (int64_t)s * J->max_blocks;
    const size_t esz = bf16 ? 2 : 4;
    const char *kb = (const char *)J->k + (size_t)g * J->head_stride * esz;
    const char *vb = (const char *)J->v + (size_t)g * J->head_stride * esz;
    const int t0 = J->seq_tok0[s], t1 = t0 + J->seq_ntok[s];
    int amin = C, bmax = 0;  /* the keys some query sees, as offsets in the chunk */
    for (int t = t0; t < t1; ++t) {
        const int pos = J->tok_pos[t], lo = first_visible(J, pos);
        const int a = (c0 > lo ? c0 : lo) - c0, b = (c0 + C < pos + 1 ? c0 + C : pos + 1) - c0;
        if (a >= b) continue;
        amin = a < amin ? a : amin;
        bmax = b > bmax ? b : bmax;
    }
    if (amin >= bmax) return;
    const int ja = amin / W * W, jb = (bmax + W - 1) / W * W;  /* whole blocks of 16 keys */
    memset(kt + (int64_t)ja * d, 0, sizeof(float) * (int64_t)(amin - ja) * d);  /* (harmless lanes: zeros) */
    memset(kt + (int64_t)(jb - W) * d, 0, sizeof(float) * (int64_t)W * d);
    for (int j = amin; j < bmax; ++j) {
        const int p = c0 + j;
        slots[j] = (int64_t)table[p / bs] * bs + p % bs;
        float *dst = kt + (int64_t)(j / W) * W * d + j % W;
        if (bf16) {
            const uint16_t *k = (const uint16_t *)kb + slots[j] * d;
            for (int i = 0; i < d; ++i) dst[i * W] = tof(k[i]);
        } else {
            const float *k = (const float *)kb + slots[j] * d;
            for (int i = 0; i < d; ++i) dst[i * W] = k[i];
        }
    }
    for (int t = t0; t < t1; ++t) {
        const int pos = J->tok_pos[t], lo = first_visible(J, pos);
        const int a = (c0 > lo ? c0 : lo) - c0, b = (c0 + C < pos + 1 ? c0 + C : pos + 1) - c0;
        if (a >= b) continue;
        const int c_rel = c - lo / C;
        for (int h = g * group; h < (g + 1) * group; ++h) {
            const float *q = J->q + ((int64_t)t * J->heads + h) * d;
            for (int j = a / W * W; j < b; j += W) {
                const float *k = kt + (int64_t)j * d;
                vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
                int i = 0;
                for (; i + 4 <= d; i += 4) {
                    a0 += splat(q[i]) * loadf(k + i * W);
                    a1 += splat(q[i + 1]) * loadf(k + (i + 1) * W);
                    a2 += splat(q[i + 2]) * loadf(k + (i + 2) * W);
                    a3 += splat(q[i + 3]) * loadf(k + (i + 3) * W);
                }
                for (; i < d; ++i) a0 += splat(q[i]) * loadf(k + i * W);
                storef(scores + j, ((a0 + a1) + (a2 + a3)) * splat(J->scale));
            }
            float m = scores[a];
            for (int j = a + 1; j < b; ++j) m = scores[j] > m ? scores[j] : m;
            for (int j = a / W * W; j < b; j += W) storef(scores + j, vexp(loadf(scores + j) - splat(m)));
            float *part = J->partials + (((int64_t)t * J->heads + h) * J->max_chunks + c_rel) * (d + 2);
            float l = 0.0f;
            for (int j = a; j < b; ++j) l += scores[j];
            if (d == 64) weighted_sum(part + 2, scores, vb, slots, a, b, d, bf16, 64);
            else if (d == 128) weighted_sum(part + 2, scores, vb, slots, a, b, d, bf16, 128);
            else if (d == 256) weighted_sum(part + 2, scores, vb, slots, a, b, d, bf16, 256);
            else weighted_sum(part + 2, scores, vb, slots, a, b, d, bf16, 0);
            part[0] = m;
            part[1] = l;
        }
    }
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

static void *worker(void *arg) {
    job_t *J = (job_t *)arg;
    float *scores = malloc(sizeof(float) * (J->chunk + W));
    int64_t *slots = malloc(sizeof(int64_t) * (J->chunk + W));
    float *kt = malloc(sizeof(float) * ((int64_t)J->d * J->chunk + W));
    for (;;) {
        int64_t i = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (i >= J->num_items) break;
        int64_t it = J->items[i];
        if (J->phase == 1) chunk_item(J, (int)(it >> 40), (int)((it >> 24) & 0xFFFF), (int)(it & 0xFFFFFF), scores, slots, kt);
        else merge_item(J, (int)(it >> 16), (int)(it & 0xFFFF));
    }
    free(scores);
    free(slots);
    free(kt);
    return NULL;
}

static void run(job_t *J, int threads) {
    J->next = 0;
    if (threads > J->num_items) threads = (int)J->num_items;
    pthread_t tid[64];
    int spawned = 0;
    for (int i = 1; i < threads && i < 64; ++i)
        if (pthread_create(&tid[spawned], NULL, worker, J) == 0) ++spawned;
    worker(J);
    for (int i = 0; i < spawned; ++i) pthread_join(tid[i], NULL);
}

/* Returns 0, or -1 when out of memory. */
int paged_attention(const float *q, const void *k_pool, const void *v_pool, int bf16, int64_t head_stride,
                    const int32_t *tables, int max_blocks, const int32_t *tok_seq, const int32_t *tok_pos,
                    const int32_t *seq_tok0, const int32_t *seq_ntok, int tokens, int seqs, int heads,
                    int kv_heads, int d, int block_size, int window, int chunk, float scale, float *partials,
                    int max_chunks, float *out, int threads) {
    job_t J = {q, k_pool, v_pool, bf16, head_stride, tables, max_blocks, tok_seq, tok_pos, seq_tok0, seq_ntok,
               seqs, heads, kv_heads, d, block_size, window, chunk, max_chunks, scale, partials, out, 0, NULL, 1, 0};
    int64_t n = 0;
    for (int s = 0; s < seqs; ++s) {
        if (!seq_ntok[s]) continue;
        int lo = 1 << 30, hi = -1;
        for (int t = seq_tok0[s]; t < seq_tok0[s] + seq_ntok[s]; ++t) {
            int a = first_visible(&J, tok_pos[t]) / chunk, b = tok_pos[t] / chunk;
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        n += (int64_t)kv_heads * (hi - lo + 1);
    }
    int64_t cap = n > (int64_t)tokens * heads ? n : (int64_t)tokens * heads;
    J.items = malloc(sizeof(int64_t) * (cap ? cap : 1));
    if (!J.items) return -1;
    n = 0;
    for (int s = 0; s < seqs; ++s) {
        if (!seq_ntok[s]) continue;
        int lo = 1 << 30, hi = -1;
        for (int t = seq_tok0[s]; t < seq_tok0[s] + seq_ntok[s]; ++t) {
            int a = first_visible(&J, tok_pos[t]) / chunk, b = tok_pos[t] / chunk;
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        for (int c = hi; c >= lo; --c)  /* the longest work first */
            for (int g = 0; g < kv_heads; ++g) J.items[n++] = ((int64_t)s << 40) | ((int64_t)g << 24) | c;
    }
    J.num_items = n;
    run(&J, threads);
    n = 0;
    for (int t = 0; t < tokens; ++t)
        for (int h = 0; h < heads; ++h) J.items[n++] = ((int64_t)t << 16) | h;
    J.num_items = n;
    J.phase = 2;
    run(&J, threads);
    free(J.items);
    return 0;
}
