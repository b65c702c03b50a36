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

static void quantize_row(const float *y, int64_t k, uint8_t *q, float *scale) {
    float peak = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
        float a = fabsf(y[j]);
        peak = a > peak ? a : peak;
    }
    if (peak < 1e-12f) peak = 1e-12f;
    float s = peak / 127.0f;
    *scale = s;
    for (int64_t j = 0; j < k; ++j) {
        float v = nearbyintf(y[j] / s);
        v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
        q[j] = (uint8_t)(int)(v + 128.0f);
    }
}

/* dtype: 0 float32, 1 bfloat16. scratch: k floats. Returns 0. */
int quantize_rows_u8(const void *x, int dtype, const float *inv_s, int64_t m, int64_t k, int64_t row_stride,
                     uint8_t *q, float *scale, float *scratch) {
    for (int64_t i = 0; i < m; ++i) {
        if (dtype == 0) {
            const float *row = (const float *)x + i * row_stride;
            if (inv_s) {
                for (int64_t j = 0; j < k; ++j) scratch[j] = row[j] * inv_s[j];
            } else {
                memcpy(scratch, row, (size_t)k * sizeof(float));
            }
        } else {
            const uint16_t *row = (const uint16_t *)x + i * row_stride;
            for (int64_t j = 0; j < k; ++j) scratch[j] = inv_s ? bf16_to_f32(row[j]) * inv_s[j] : bf16_to_f32(row[j]);
        }
        quantize_row(scratch, k, q + i * k, scale + i);
    }
    return 0;
}
