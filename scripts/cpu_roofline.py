"""What this CPU can do at most: float32 FMA throughput and memory read bandwidth per thread count.

The two roofs the CPU engine's figures are read against (docs/benchmarks.md): a prefill is
bound by FMAs, a decode step over a long context by reading its KV cache. A small C program
(GCC vector extensions, built here with ``-O3 -march=native``) runs on 1..N threads:

- ``fma``: each thread keeps 12 independent vector accumulators (more than an FMA unit's
  latency × issue width needs) and counts 2 FLOPs per lane per FMA;
- ``read``: each thread sums its share of a 256 MiB float32 array (touched first, so no
  page faults are timed), best of 5 passes.

    python scripts/cpu_roofline.py --threads 1,2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float vec __attribute__((vector_size(64)));
#define LANES 16
#define ACCUMULATORS 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct job { long iterations; const float *data; long count; double result; };

static void *fma_loop(void *arg) {
    struct job *job = arg;
    vec acc[ACCUMULATORS], x, y;
    for (int i = 0; i < LANES; ++i) { x[i] = 0.999999f; y[i] = 1e-7f; }
    for (int a = 0; a < ACCUMULATORS; ++a) acc[a] = x * (float)(a + 1);
    for (long n = 0; n < job->iterations; ++n)
        for (int a = 0; a < ACCUMULATORS; ++a) acc[a] = acc[a] * x + y;
    float sum = 0;
    for (int a = 0; a < ACCUMULATORS; ++a) for (int i = 0; i < LANES; ++i) sum += acc[a][i];
    job->result = sum;
    return NULL;
}

static void *read_loop(void *arg) {
    struct job *job = arg;
    const vec *v = (const vec *)job->data;
    vec s[8] = {{0}};
    for (long i = 0; i + 8 <= job->count / LANES; i += 8)
        for (int k = 0; k < 8; ++k) s[k] += v[i + k];
    for (int k = 1; k < 8; ++k) s[0] += s[k];
    float sum = 0;
    for (int i = 0; i < LANES; ++i) sum += s[0][i];
    job->result = sum;
    return NULL;
}

static double run(int threads, void *(*fn)(void *), struct job *jobs) {
    pthread_t ids[64];
    double start = now();
    for (int t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, fn, &jobs[t]);
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    return now() - start;
}

int main(int argc, char **argv) {
    int threads = atoi(argv[1]);
    struct job jobs[64];
    long iterations = 200000000L / ACCUMULATORS;
    for (int t = 0; t < threads; ++t) jobs[t].iterations = iterations;
    double fma_s = run(threads, fma_loop, jobs);
    double flops = 2.0 * LANES * ACCUMULATORS * (double)iterations * threads;

    long count = (256L << 20) / sizeof(float);
    float *data = aligned_alloc(64, count * sizeof(float));
    for (long i = 0; i < count; ++i) data[i] = (float)(i & 1023);
    double best = 1e30;
    for (int pass = 0; pass < 5; ++pass) {
        for (int t = 0; t < threads; ++t) { jobs[t].data = data + count / threads * t; jobs[t].count = count / threads; }
        double s = run(threads, read_loop, jobs);
        if (s < best) best = s;
    }
    printf("%d %.1f %.1f\n", threads, flops / fma_s * 1e-9, count * sizeof(float) / best * 1e-9);
    free(data);
    return 0;
}
"""


def build(directory: Path) -> Path:
    source, binary = directory / "roofline.c", directory / "roofline"
    source.write_text(PROGRAM)
    subprocess.run(["gcc", "-O3", "-march=native", "-ffp-contract=fast", "-pthread", str(source), "-o", str(binary)],
                   check=True)
    return binary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=",".join(str(n) for n in range(1, (os.cpu_count() or 1) + 1)),
                        help="comma-separated thread counts (default: 1..cores)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        binary = build(Path(directory))
        print("| threads | float32 FMA GFLOPS | memory read GB/s |\n| ---: | ---: | ---: |")
        for threads in (int(n) for n in args.threads.split(",")):
            _, gflops, read_gbs = subprocess.run([str(binary), str(threads)], check=True, capture_output=True,
                                                 text=True).stdout.split()
            print(f"| {threads} | {float(gflops):,.1f} | {float(read_gbs):,.1f} |")


if __name__ == "__main__":
    main()
