/* mpi_allreduce_bench.c - the MPI baseline of ps_bench --mpi-baseline: times
 * MPI_Allreduce (float32 sum, separate send and receive buffers: a
 * gradient in, the reduced values out) of each size given, and prints one
 * JSON line per size from rank 0:
 *
 *   {"name":"mpi_allreduce","bytes":B,"ranks":R,"iters":N,"step_ms":MEDIAN,
 *    "max_step_ms":SLOWEST,"library":"Open MPI v..."}
 *
 * step_ms is the median over rank 0's timed calls, as ps_bench reports
 * the median over worker 0's steps. After the timed calls every rank
 * checks the reduced values (rank r contributes r + 1 to every element)
 * and the program exits 1 when one is wrong.
 *
 *   mpirun -np R mpi_allreduce_bench --sizes 4,1048576 --iters 20 \
 *          [--big-iters N:B]   (sizes of B bytes or more run N iterations)
 *   mpi_allreduce_bench --shm-btl     (no MPI_Init: prints the name of
 *                                      Open MPI's shared-memory BTL)
 *
 * Built only where CMake finds Open MPI (examples/ps_bench/CMakeLists.txt). */
#include <mpi.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SIZES 32             /* entries of --sizes, as ps_bench's MAX_LIST */
/* --sizes bound: MPI counts are int, so at most INT_MAX floats. */
#define MAX_BYTES ((unsigned long long)INT_MAX * 4)
#define MAX_ITERS 1000000        /* --iters bound, as ps_bench's --steps */
#define WARMUP_ITERS 2           /* untimed calls first, as ps_bench's WARMUP_STEPS */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Parses "B[,B...]" (plain byte counts: ps_bench passes them resolved). */
static int parse_sizes(const char *s, uint64_t *out, int *n) {
  *n = 0;
  while (*s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || v == 0 || v > MAX_BYTES || *n >= MAX_SIZES) return -1;
    out[(*n)++] = v;
    if (*end == ',' && end[1]) s = end + 1;
    else if (*end == '\0') s = end;
    else return -1;
  }
  return *n ? 0 : -1;
}

/* Times iters calls of numel floats; prints rank 0's line. 0, or -1 when
 * memory ran out or the reduced values are wrong (on any rank). */
static int bench_size(uint64_t bytes, int iters, int rank, int ranks, const char *lib) {
  size_t numel = bytes / 4 ? (size_t)(bytes / 4) : 1;
  float *send = malloc(numel * sizeof *send), *recv = malloc(numel * sizeof *recv);
  double *t = malloc((size_t)iters * sizeof *t);
  int ok = send && recv && t, all_ok;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok) {
    if (!ok) fprintf(stderr, "mpi_allreduce_bench: rank %d: out of memory\n", rank);
    free(send), free(recv), free(t);
    return -1;
  }
  for (size_t i = 0; i < numel; i++) send[i] = (float)(rank + 1), recv[i] = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  for (int i = 0; i < WARMUP_ITERS + iters; i++) {
    double t0 = MPI_Wtime();
    MPI_Allreduce(send, recv, (int)numel, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (i >= WARMUP_ITERS) t[i - WARMUP_ITERS] = MPI_Wtime() - t0;
  }
  float expect = (float)ranks * (float)(ranks + 1) / 2.0f;
  size_t bad = 0;
  for (size_t i = 0; i < numel; i++) bad += recv[i] != expect;
  if (bad)
    fprintf(stderr, "mpi_allreduce_bench: rank %d: %zu of %zu reduced values wrong "
            "(expected %g)\n", rank, bad, numel, (double)expect);
  ok = bad == 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0 && all_ok) {
    double slowest = 0;
    for (int i = 0; i < iters; i++) slowest = t[i] > slowest ? t[i] : slowest;
    qsort(t, (size_t)iters, sizeof *t, cmp_double);
    double med = iters % 2 ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
    printf("{\"name\":\"mpi_allreduce\",\"bytes\":%llu,\"ranks\":%d,\"iters\":%d,"
           "\"step_ms\":%.6g,\"max_step_ms\":%.6g,\"library\":\"%s\"}\n",
           (unsigned long long)numel * 4, ranks, iters, med * 1e3, slowest * 1e3, lib);
    fflush(stdout);
  }
  free(send), free(recv), free(t);
  return all_ok ? 0 : -1;
}

/* The library's version, first line, with quotes and controls dropped. */
static void library_name(char *buf, size_t len) {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  MPI_Get_library_version(v, &n);
  size_t k = 0;
  for (int i = 0; i < n && v[i] && v[i] != '\n' && v[i] != ',' && k + 1 < len; i++)
    if (v[i] != '"' && v[i] != '\\' && (unsigned char)v[i] >= 0x20) buf[k++] = v[i];
  buf[k] = '\0';
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "--shm-btl")) {
    /* Open MPI 5 renamed the shared-memory BTL "vader" to "sm". */
#if defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5
    puts("sm");
#else
    puts("vader");
#endif
    return 0;
  }
  uint64_t sizes[MAX_SIZES];
  int nsizes = 0;
  long iters = 20, big_iters = 0;
  unsigned long long big_bytes = 0;
  for (int a = 1; a < argc; a++) {
    char *end = NULL;
    if (!strcmp(argv[a], "--sizes") && a + 1 < argc) {
      if (parse_sizes(argv[++a], sizes, &nsizes) != 0) {
        fprintf(stderr, "mpi_allreduce_bench: --sizes: invalid value '%s' (byte counts "
                "from 1 to %llu, comma-separated)\n", argv[a], MAX_BYTES);
        return 2;
      }
    } else if (!strcmp(argv[a], "--iters") && a + 1 < argc) {
      iters = strtol(argv[++a], &end, 10);
      if (*end || iters < 1 || iters > MAX_ITERS) {
        fprintf(stderr, "mpi_allreduce_bench: --iters: invalid value '%s' (1 to %d)\n",
                argv[a], MAX_ITERS);
        return 2;
      }
    } else if (!strcmp(argv[a], "--big-iters") && a + 1 < argc) {
      big_iters = strtol(argv[++a], &end, 10);
      if (*end == ':') big_bytes = strtoull(end + 1, &end, 10);
      if (*end || big_iters < 1 || big_iters > MAX_ITERS || big_bytes == 0) {
        fprintf(stderr, "mpi_allreduce_bench: --big-iters: invalid value '%s' (N:BYTES)\n",
                argv[a]);
        return 2;
      }
    } else {
      fprintf(stderr, "usage: mpirun -np R mpi_allreduce_bench --sizes B[,B...] "
              "[--iters N] [--big-iters N:B]\n       mpi_allreduce_bench --shm-btl\n");
      return 2;
    }
  }
  if (!nsizes) {
    fprintf(stderr, "mpi_allreduce_bench: --sizes is required\n");
    return 2;
  }
  MPI_Init(&argc, &argv);
  int rank, ranks;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  char lib[128];
  library_name(lib, sizeof lib);
  int rc = 0;
  for (int s = 0; s < nsizes && rc == 0; s++)
    rc = bench_size(sizes[s], (int)(big_iters && sizes[s] >= big_bytes ? big_iters : iters),
                    rank, ranks, lib);
  MPI_Finalize();
  return rc ? 1 : 0;
}
