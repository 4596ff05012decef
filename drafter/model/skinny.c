/* tlt-scheduler's few-row float32 product for CPU decoding (drafter/model/skinny.py builds and loads it).

   out (M, N) = x (M, K) @ W.T (+ bias (N) or + add (M, N)), M <= SKINNY_MAX_ROWS, on W packed as (N / 8, K, 8):
   each block of 8 output columns reads its weights once, as one sequential stream, for every row at a time. A
   decode step of a few rows is bound by reading the weights; oneDNN's and MKL's GEMMs read them at up to 2x one
   row's cost at 2-6 rows on an AVX2 CPU, this at about one row's (docs/benchmarks.md, "Few-row products").

   Each output is summed in the same order whatever M is (two partial sums, even and odd k, then added), so a row
   gets the same bits in a product of 2 rows as of 6. K must be even and N a multiple of 8. */
#include <immintrin.h>
#include <stddef.h>

#define SKINNY_MAX_ROWS 6
#define COLS 8

int tlt_skinny_max_rows(void) { return SKINNY_MAX_ROWS; }

static inline void block(int M, int K, const float *x, const float *wp, float *out, int ldo,
                         const float *bias, const float *add) {
  __m256 even[SKINNY_MAX_ROWS], odd[SKINNY_MAX_ROWS];
  for (int m = 0; m < M; m++) {
    even[m] = _mm256_setzero_ps();
    odd[m] = _mm256_setzero_ps();
  }
  for (int k = 0; k < K; k += 2) {
    const float *p = wp + (size_t)k * COLS;
    _mm_prefetch((const char *)(p + 128), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + COLS);
    for (int m = 0; m < M; m++) {
      even[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (size_t)m * K + k), w0, even[m]);
      odd[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (size_t)m * K + k + 1), w1, odd[m]);
    }
  }
  for (int m = 0; m < M; m++) {
    __m256 y = _mm256_add_ps(even[m], odd[m]);
    if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias));
    if (add) y = _mm256_add_ps(_mm256_loadu_ps(add + (size_t)m * ldo), y);
    _mm256_storeu_ps(out + (size_t)m * ldo, y);
  }
}

/* one function per row count: the compiler unrolls the rows' loop and keeps every sum in a register */
#define ROWS(MM)                                                                                          \
  static void rows##MM(int K, int N, const float *x, const float *wp, float *out, const float *bias,     \
                       const float *add) {                                                                \
    for (int nb = 0; nb < N / COLS; nb++)                                                                 \
      block(MM, K, x, wp + (size_t)nb * K * COLS, out + (size_t)nb * COLS, N, bias ? bias + nb * COLS : 0, \
            add ? add + (size_t)nb * COLS : 0);                                                           \
  }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)

typedef void (*rows_fn)(int, int, const float *, const float *, float *, const float *, const float *);
static const rows_fn BY_ROWS[SKINNY_MAX_ROWS + 1] = {0, rows1, rows2, rows3, rows4, rows5, rows6};

/* 0 on success, -1 on shapes it does not take (the caller checks them first) */
int tlt_skinny(int M, int K, int N, const float *x, const float *wp, float *out, const float *bias,
               const float *add) {
  if (M < 1 || M > SKINNY_MAX_ROWS || K < 2 || K % 2 || N < COLS || N % COLS) return -1;
  BY_ROWS[M](K, N, x, wp, out, bias, add);
  return 0;
}
