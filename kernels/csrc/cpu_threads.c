/* The native library's threads: a small pool that runs one job at a time on the calling
 * thread and up to SHOAL_MAX_THREADS - 1 helpers, with a barrier between a job's phases.
 *
 * Why not OpenMP: torch already runs its own OpenMP runtime in the process, and two
 * runtimes spinning on two cores fight each other. These helpers spin only briefly
 * (SPIN_NS) while they wait, for a job or at a barrier, then sleep on a futex: a decode step
 * of a small model is a fraction of a millisecond and its phases a few microseconds, so
 * waking a sleeping thread for each would cost more than the phase; but a helper that spun
 * between steps would take the core from the worker's event loop and NATS.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cpu_model.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SHOAL_HAVE_FUTEX 1
#else
#include <sched.h>
#define SHOAL_HAVE_FUTEX 0
#endif

/* How long a waiting thread spins before it sleeps. */
#define SPIN_NS 50000

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void futex_wait(atomic_uint *word, unsigned expected) {
#if SHOAL_HAVE_FUTEX
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
#else
    (void)word;
    (void)expected;
    sched_yield();
#endif
}

static void futex_wake_all(atomic_uint *word) {
#if SHOAL_HAVE_FUTEX
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Returns once *word != seen: spins SPIN_NS, then sleeps (counted in *sleepers, so that
 * signal_change knows whether to make the system call). Sequentially consistent
 * operations on both sides: a signaller either sees the sleeper counted or the sleeper
 * sees the new value before it sleeps (and futex_wait re-checks it atomically). */
static void wait_for_change(atomic_uint *word, unsigned seen, atomic_int *sleepers) {
    uint64_t deadline = 0;
    for (unsigned i = 1;; ++i) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) {
            return;
        }
        if ((i & 255u) == 0) {
            const uint64_t now = now_ns();
            if (deadline == 0) {
                deadline = now + SPIN_NS;
            } else if (now > deadline) {
                break;
            }
        }
        cpu_relax();
    }
    atomic_fetch_add(sleepers, 1);
    while (atomic_load(word) == seen) {
        futex_wait(word, seen);
    }
    atomic_fetch_sub(sleepers, 1);
}

static void signal_change(atomic_uint *word, atomic_int *sleepers) {
    atomic_fetch_add(word, 1);
    if (atomic_load(sleepers) > 0) {
        futex_wake_all(word);
    }
}

static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER;
static int num_helpers; /* started, under submit_lock */
static unsigned helper_start_generation[SHOAL_MAX_THREADS];

static atomic_uint job_generation;
static atomic_int job_sleepers;
static shoal_job current_job;
static void *current_arg;
static int current_threads;

static atomic_uint barrier_arrived;
static atomic_uint barrier_generation;
static atomic_int barrier_sleepers;

/* The number of threads of the job this thread is running (1 outside jobs). */
static _Thread_local int tls_job_threads = 1;

void shoal_job_barrier(void) {
    const int n = tls_job_threads;
    if (n <= 1) {
        return;
    }
    const unsigned generation = atomic_load(&barrier_generation);
    if (atomic_fetch_add(&barrier_arrived, 1) == (unsigned)n - 1) {
        atomic_store(&barrier_arrived, 0); /* before anyone can leave: they wait for the generation */
        signal_change(&barrier_generation, &barrier_sleepers);
    } else {
        wait_for_change(&barrier_generation, generation, &barrier_sleepers);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1 .. */
    unsigned seen = helper_start_generation[index];
    for (;;) {
        wait_for_change(&job_generation, seen, &job_sleepers);
        seen = atomic_load(&job_generation);
        const int n = current_threads;
        if (index < n) {
            tls_job_threads = n;
            current_job(current_arg, index, n);
            shoal_job_barrier(); /* the job's end: after it the caller may post the next one */
            tls_job_threads = 1;
        }
    }
    return NULL;
}

/* Starts helpers until there are `wanted` (under submit_lock); returns how many there are. */
static int start_helpers(int wanted) {
    while (num_helpers < wanted) {
        const int index = num_helpers + 1;
        helper_start_generation[index] = atomic_load(&job_generation);
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        pthread_t thread;
        const int failed = pthread_create(&thread, &attributes, helper_main, (void *)(intptr_t)index);
        pthread_attr_destroy(&attributes);
        if (failed) {
            break;
        }
        ++num_helpers;
    }
    return num_helpers;
}

void shoal_run_job(shoal_job job, void *arg, int num_threads) {
    if (num_threads > SHOAL_MAX_THREADS) {
        num_threads = SHOAL_MAX_THREADS;
    }
    if (num_threads <= 1) {
        const int outer = tls_job_threads;
        tls_job_threads = 1;
        job(arg, 0, 1);
        tls_job_threads = outer;
        return;
    }
    pthread_mutex_lock(&submit_lock);
    const int helpers = start_helpers(num_threads - 1);
    if (helpers + 1 < num_threads) {
        num_threads = helpers + 1;
    }
    current_job = job;
    current_arg = arg;
    current_threads = num_threads;
    tls_job_threads = num_threads;
    signal_change(&job_generation, &job_sleepers);
    job(arg, 0, num_threads);
    shoal_job_barrier();
    tls_job_threads = 1;
    pthread_mutex_unlock(&submit_lock);
}
