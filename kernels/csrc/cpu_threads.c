/* The native library's threads: the calling thread and up to SHOAL_MAX_THREADS - 1 helpers
 * run a program of phases (shoal_run_phases), each phase a number of independent work items
 * that depend on every item of the phases before.
 *
 * Work is claimed, not assigned: each thread takes the next unclaimed item from one shared
 * counter, waits (only) until the phases before that item's are complete, runs it and counts
 * it done. A helper that is not on a core while the program runs (the worker's event loop,
 * NATS or another process holds it) simply claims nothing: the caller does the work, instead
 * of waiting at a barrier for a thread that is not running. It waits only for items another
 * thread has claimed and not finished.
 *
 * The claim counter carries the program's generation, so a helper that wakes late for a
 * finished program cannot claim an item of it, nor of the next one, by mistake:
 *
 *   claim word  =  generation (24 bits) | number of items (20) | next item (20)
 *
 * A successful claim (a compare-and-swap on that word) means the program is live: its
 * caller waits for every item to be done before it returns, so what the program points to
 * stays valid while the item runs.
 *
 * Why not OpenMP: torch runs its own OpenMP runtime in the process, and two runtimes
 * spinning on two cores fight each other. Waiting threads here spin briefly (SPIN_NS), then
 * sleep on a futex.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "cpu_model.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SHOAL_HAVE_FUTEX 1
#else
#define SHOAL_HAVE_FUTEX 0
#endif

/* How long a waiting thread spins before it sleeps. */
#define SPIN_NS 50000
/* How long a helper that finished a program keeps looking for the next one (yielding its core
 * to any other thread that wants it) before it sleeps: an engine's steps come a fraction of a
 * millisecond apart, and waking a sleeping thread costs tens to hundreds of microseconds on a
 * virtual machine, during which the caller runs the next program alone. It stops looking at
 * once when told the next programs will not want it (helpers_may_spin, below). */
#define IDLE_YIELD_NS 2000000

#define ITEM_BITS 20
#define MAX_ITEMS ((1u << ITEM_BITS) - 1)
#define GENERATION_SHIFT (2 * ITEM_BITS)
#define GENERATION_MASK ((1u << 24) - 1)

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

/* Whether a waited-for word got there: changed from target, or at least target. */
static int reached(unsigned value, unsigned target, int until_changed) {
    return until_changed ? value != target : value >= target;
}

/* What an idle helper's wait needs besides the word it waits on: how long to look before it
 * sleeps, the flag that tells it to stop looking now, and where to count how it went to
 * sleep (shoal_thread_stats). */
struct idle_watch {
    uint64_t yield_ns;
    const atomic_int *keep_looking;
    atomic_llong *num_told;
    atomic_llong *num_timed_out;
};

/* Returns once *word reached target (reached(value) below): spins SPIN_NS (plus the idle
 * watch's yield_ns, yielding the core), then sleeps, counted in *sleepers so that wakers know
 * whether to make the system call. Sequentially consistent operations on both sides: a waker
 * either sees the sleeper counted, or the sleeper sees the new value before it sleeps (and
 * futex_wait re-checks it atomically). */
static void wait_on(atomic_uint *word, unsigned target, int until_changed, atomic_int *sleepers,
                    const struct idle_watch *idle) {
    const uint64_t yield_ns = idle != NULL ? idle->yield_ns : 0;
    uint64_t start = 0;
    for (unsigned i = 1;; ++i) {
        if (reached(atomic_load_explicit(word, memory_order_acquire), target, until_changed)) {
            return;
        }
        if ((i & 255u) == 0) {
            if (idle != NULL && !atomic_load_explicit(idle->keep_looking, memory_order_relaxed)) {
                atomic_fetch_add(idle->num_told, 1);
                break;
            }
            const uint64_t now = now_ns();
            if (start == 0) {
                start = now;
            } else if (now > start + SPIN_NS + yield_ns) {
                if (idle != NULL) {
                    atomic_fetch_add(idle->num_timed_out, 1);
                }
                break;
            } else if (now > start + SPIN_NS) {
                sched_yield(); /* any other thread that wants this core runs first */
            }
        }
        cpu_relax();
    }
    atomic_fetch_add(sleepers, 1);
    for (;;) {
        const unsigned value = atomic_load(word);
        if (reached(value, target, until_changed)) {
            break;
        }
        futex_wait(word, value);
    }
    atomic_fetch_sub(sleepers, 1);
}

static void bump(atomic_uint *word, atomic_int *sleepers) {
    atomic_fetch_add(word, 1);
    if (atomic_load(sleepers) > 0) {
        futex_wake_all(word);
    }
}

static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER;
static int num_helpers; /* started, under submit_lock */
static unsigned helper_start_posts[SHOAL_MAX_THREADS];

static atomic_uint posts; /* bumped when a program is posted: helpers sleep on it */
static atomic_int post_sleepers;
/* 1 from a program posted to the helpers until the caller runs one alone (too small to
 * share) or rests: while 0 an idle helper sleeps at once instead of looking for the next
 * program. A helper spinning or yielding on its core for nothing keeps that core from the
 * threads that carry the step's results out (the event loop, NATS, the gateway): Linux
 * places them on a free core, and a spinning thread's core is not free. */
static atomic_int helpers_may_spin;
/* shoal_thread_stats: programs posted to helpers; helpers' idle waits that ended asleep, told
 * to rest or after looking for IDLE_YIELD_NS. */
static atomic_llong num_shared_programs, num_idle_told, num_idle_timed_out;
static _Atomic uint64_t claim_word;
static atomic_uint num_done; /* items of the live program done */
static atomic_int done_sleepers;
static const struct shoal_phase *program;
static int64_t phase_ends[SHOAL_MAX_PHASES]; /* cumulative item counts */
static int program_threads;                  /* threads the caller wants at most */

/* Claims and runs items of the live program of `generation` until none is left. */
static void run_items(uint64_t generation) {
    int64_t phase = 0;
    for (;;) {
        uint64_t word = atomic_load(&claim_word);
        uint64_t item;
        for (;;) {
            if ((word >> GENERATION_SHIFT) != generation) {
                return; /* another program: this one is over */
            }
            item = word & MAX_ITEMS;
            if (item >= ((word >> ITEM_BITS) & MAX_ITEMS)) {
                return; /* all claimed */
            }
            if (atomic_compare_exchange_weak(&claim_word, &word, word + 1)) {
                break;
            }
        }
        while (phase_ends[phase] <= (int64_t)item) {
            ++phase;
        }
        const int64_t first = phase == 0 ? 0 : phase_ends[phase - 1];
        if (first > 0) {
            wait_on(&num_done, (unsigned)first, 0, &done_sleepers, NULL);
        }
        const struct shoal_phase *p = &program[phase];
        p->run(p->context, (int64_t)item - first);
        bump(&num_done, &done_sleepers);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1 .. */
    unsigned seen = helper_start_posts[index];
    const struct idle_watch idle = {IDLE_YIELD_NS, &helpers_may_spin, &num_idle_told, &num_idle_timed_out};
    for (;;) {
        wait_on(&posts, seen, 1, &post_sleepers, &idle);
        seen = atomic_load(&posts);
        const uint64_t word = atomic_load(&claim_word);
        if (index < program_threads) {
            run_items(word >> GENERATION_SHIFT);
        }
    }
    return NULL;
}

/* Pins helper `index` (1 ..) to one of the CPUs this process may use, another than the
 * caller's now: left to itself, Linux kept the helper on the caller's CPU (the futex wake
 * places the wakee next to its waker, and two busy threads on one CPU are "cache hot" to
 * the load balancer), so the two shared one core while the other stayed idle (measured:
 * no speedup at all from a second thread). A pinned helper stays put; the caller, free,
 * is the one the balancer moves when both want that CPU. Nothing is pinned on a single CPU. */
static void pin_helper(pthread_attr_t *attributes, int index) {
#if defined(__linux__)
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) {
        return;
    }
    const int current = sched_getcpu();
    int candidates[CPU_SETSIZE], num_candidates = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (CPU_ISSET(cpu, &allowed) && cpu != current) {
            candidates[num_candidates++] = cpu;
        }
    }
    if (num_candidates == 0) {
        return;
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(candidates[(index - 1) % num_candidates], &one);
    pthread_attr_setaffinity_np(attributes, sizeof one, &one);
#else
    (void)attributes;
    (void)index;
#endif
}

/* Starts helpers until there are `wanted` (under submit_lock); returns how many there are. */
static int start_helpers(int wanted) {
    while (num_helpers < wanted) {
        const int index = num_helpers + 1;
        helper_start_posts[index] = atomic_load(&posts);
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        pin_helper(&attributes, index);
        pthread_t thread;
        const int failed = pthread_create(&thread, &attributes, helper_main, (void *)(intptr_t)index);
        pthread_attr_destroy(&attributes);
        if (failed) {
            break;
        }
#if defined(__linux__)
        char name[16];
        snprintf(name, sizeof name, "shoal-fwd-%d", index);
        pthread_setname_np(thread, name); /* what top -H and py-spy show */
#endif
        ++num_helpers;
    }
    return num_helpers;
}

void shoal_rest_threads(void) {
    if (atomic_load_explicit(&helpers_may_spin, memory_order_relaxed)) {
        atomic_store(&helpers_may_spin, 0);
    }
}

void shoal_thread_stats(int64_t *out) {
    pthread_mutex_lock(&submit_lock);
    out[0] = num_helpers;
    pthread_mutex_unlock(&submit_lock);
    out[1] = atomic_load(&num_shared_programs);
    out[2] = atomic_load(&num_idle_told);
    out[3] = atomic_load(&num_idle_timed_out);
}

int shoal_run_phases(const struct shoal_phase *phases, int64_t num_phases, int num_threads) {
    if (num_phases > SHOAL_MAX_PHASES) {
        return -1;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < num_phases; ++i) {
        total += phases[i].num_items;
    }
    if (total > MAX_ITEMS) {
        return -1;
    }
    if (num_threads > SHOAL_MAX_THREADS) {
        num_threads = SHOAL_MAX_THREADS;
    }
    if (num_threads <= 1 || total <= 1) { /* inline: no helpers */
        shoal_rest_threads();
        for (int64_t i = 0; i < num_phases; ++i) {
            for (int64_t item = 0; item < phases[i].num_items; ++item) {
                phases[i].run(phases[i].context, item);
            }
        }
        return 0;
    }
    pthread_mutex_lock(&submit_lock);
    const int helpers = start_helpers(num_threads - 1);
    program = phases;
    int64_t end = 0;
    for (int64_t i = 0; i < num_phases; ++i) {
        end += phases[i].num_items;
        phase_ends[i] = end;
    }
    program_threads = helpers + 1 < num_threads ? helpers + 1 : num_threads;
    atomic_store(&num_done, 0);
    atomic_store(&helpers_may_spin, 1);
    atomic_fetch_add(&num_shared_programs, 1);
    const uint64_t generation = ((atomic_load(&claim_word) >> GENERATION_SHIFT) + 1) & GENERATION_MASK;
    atomic_store(&claim_word, (generation << GENERATION_SHIFT) | ((uint64_t)total << ITEM_BITS));
    bump(&posts, &post_sleepers);
    run_items(generation);
    wait_on(&num_done, (unsigned)total, 0, &done_sleepers, NULL);
    pthread_mutex_unlock(&submit_lock);
    return 0;
}
