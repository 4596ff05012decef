/* tlt-scheduler's few-row float32 product for CPU decoding (drafter/model/skinny.py builds and loads it).

   out (M, N) = x (M, K) @ W.T (+ bias (N) or + add (M, N)), M <= SKINNY_MAX_ROWS, on W packed as (N / 8, K, 8):
   each block of 8 output columns reads its weights once, as one sequential stream, for every row at a time. A
   decode step of a few rows is bound by reading the weights; oneDNN's and MKL's GEMMs read them at up to 2x one
   row's cost at 2-10 rows on an AVX2 CPU, this at about one row's (docs/benchmarks.md, "Few-row products").

   Each output is one sum over k in order (one accumulator, fused multiply-adds), whatever M is and however the
   blocks are walked (two at a time for up to 4 rows, one at a time above), so a row gets the same bits in a
   product of 2 rows as of 10. K must be even and N a multiple of 8. */
#include <immintrin.h>
#include <stddef.h>

#define SKINNY_MAX_ROWS 10 /* past it, the sums spill out of the 16 registers */
#define PAIRED_ROWS 4 /* up to this many rows, two blocks a pass: 2 x 4 sums in registers */
#define COLS 8

int tlt_skinny_max_rows(void) { return SKINNY_MAX_ROWS; }

static inline __m256 finish(__m256 y, const float *bias, const float *add) {
  if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias));
  if (add) y = _mm256_add_ps(_mm256_loadu_ps(add), y);
  return y;
}

/* one block of 8 columns, M rows (M <= SKINNY_MAX_ROWS) */
static inline __attribute__((always_inline)) void one_block(int M, int K, const float *x, const float *wp, float *out, int ldo, const float *bias,
                             const float *add) {
  __m256 acc[SKINNY_MAX_ROWS];
  for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
  for (int k = 0; k < K; k++) {
    const float *p = wp + (size_t)k * COLS;
    _mm_prefetch((const char *)(p + 128), _MM_HINT_T0);
    __m256 w = _mm256_loadu_ps(p);
    for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (size_t)m * K + k), w, acc[m]);
  }
  for (int m = 0; m < M; m++)
    _mm256_storeu_ps(out + (size_t)m * ldo, finish(acc[m], bias, add ? add + (size_t)m * ldo : 0));
}

/* two adjacent blocks (16 columns), M rows (M <= PAIRED_ROWS): two weight streams, twice the sums in flight */
static inline __attribute__((always_inline)) void two_blocks(int M, int K, const float *x, const float *wp, float *out, int ldo, const float *bias,
                              const float *add) {
  __m256 a0[PAIRED_ROWS], a1[PAIRED_ROWS];
  const float *wq = wp + (size_t)K * COLS;
  for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int k = 0; k < K; k++) {
    const float *p = wp + (size_t)k * COLS, *q = wq + (size_t)k * COLS;
    _mm_prefetch((const char *)(p + 128), _MM_HINT_T0);
    _mm_prefetch((const char *)(q + 128), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(q);
    for (int m = 0; m < M; m++) {
      __m256 b = _mm256_broadcast_ss(x + (size_t)m * K + k);
      a0[m] = _mm256_fmadd_ps(b, w0, a0[m]);
      a1[m] = _mm256_fmadd_ps(b, w1, a1[m]);
    }
  }
  for (int m = 0; m < M; m++) {
    const float *am = add ? add + (size_t)m * ldo : 0;
    _mm256_storeu_ps(out + (size_t)m * ldo, finish(a0[m], bias, am));
    _mm256_storeu_ps(out + (size_t)m * ldo + COLS, finish(a1[m], bias ? bias + COLS : 0, am ? am + COLS : 0));
  }
}

/* one function per row count: the compiler unrolls the rows' loop and keeps every sum in a register */
#define ROWS(MM)                                                                                               \
  static void rows##MM(int K, int N, const float *x, const float *wp, float *out, const float *bias,          \
                       const float *add) {                                                                     \
    int blocks = N / COLS, nb = 0;                                                                             \
    if (MM <= PAIRED_ROWS)                                                                                     \
      for (; nb + 2 <= blocks; nb += 2)                                                                        \
        two_blocks(MM, K, x, wp + (size_t)nb * K * COLS, out + (size_t)nb * COLS, N,                          \
                   bias ? bias + (size_t)nb * COLS : 0, add ? add + (size_t)nb * COLS : 0);                   \
    for (; nb < blocks; nb++)                                                                                  \
      one_block(MM, K, x, wp + (size_t)nb * K * COLS, out + (size_t)nb * COLS, N,                             \
                bias ? bias + (size_t)nb * COLS : 0, add ? add + (size_t)nb * COLS : 0);                      \
  }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10)

typedef void (*rows_fn)(int, int, const float *, const float *, float *, const float *, const float *);
static const rows_fn BY_ROWS[SKINNY_MAX_ROWS + 1] = {0,     rows1, rows2, rows3, rows4, rows5,
                                                     rows6, rows7, rows8, rows9, rows10};

/* 0 on success, -1 on shapes it does not take (the caller checks them first) */
int tlt_skinny(int M, int K, int N, const float *x, const float *wp, float *out, const float *bias,
               const float *add) {
  if (M < 1 || M > SKINNY_MAX_ROWS || K < 2 || K % 2 || N < COLS || N % COLS) return -1;
  BY_ROWS[M](K, N, x, wp, out, bias, add);
  return 0;
}
