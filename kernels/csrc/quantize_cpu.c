/* Per-token int8 quantization of activations for specdec's W8A8 products (specdec/engine/quant.py).
 *
 * For each row i of x [m, k] (float32 or bfloat16), with an optional per-column smoothing factor
 * inv_s [k] (SmoothQuant: the activations are divided by s, the weights were multiplied by it):
 *     y_j   = x_ij * inv_s_j                       (float32)
 *     scale = max_j |y_j| / 127                    (at least 1e-12 / 127)
 *     q_ij  = round_half_even(y_j / scale) + 128   (u8; oneDNN's zero point of 128)
 * exactly what the torch formulation in quant.quantize_rows computes, in one call instead of ~10 operators
 * (each a dispatch and a temporary): the same bits, cheaper by the overhead. Rows are independent, so a row's
 * result never depends on the others (batch invariance).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x_j * inv_s_j as float32: the same product in both passes, so the same bits as the torch formulation */
static inline float load(const void *x, int dtype, const float *inv_s, int64_t j) {
    float v = dtype == 0 ? ((const float *)x)[j] : bf16_to_f32(((const uint16_t *)x)[j]);
    return inv_s ? v * inv_s[j] : v;
}

/* dtype: 0 float32, 1 bfloat16; row_stride in elements. Returns 0. */
int quantize_rows_u8(const void *x, int dtype, const float *inv_s, int64_t m, int64_t k, int64_t row_stride,
                     uint8_t *q, float *scale) {
    const size_t elem = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    for (int64_t i = 0; i < m; ++i) {
        const void *row = (const char *)x + (size_t)(i * row_stride) * elem;
        float peak = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            float a = fabsf(load(row, dtype, inv_s, j));
            peak = a > peak ? a : peak;
        }
        if (peak < 1e-12f) peak = 1e-12f;
        float s = peak / 127.0f;
        scale[i] = s;
        uint8_t *out = q + i * k;
        for (int64_t j = 0; j < k; ++j) {
            float v = nearbyintf(load(row, dtype, inv_s, j) / s);
            v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
            out[j] = (uint8_t)(int)(v + 128.0f);
        }
    }
    return 0;
}
