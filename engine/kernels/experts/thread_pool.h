/* The CPU expert kernels' own worker threads (thread_pool.c). */
#ifndef GLMFLASH_THREAD_POOL_H
#define GLMFLASH_THREAD_POOL_H

#include <sched.h>
#include <stdint.h>
#include <time.h>

/* One share of a job: `id` in [0, team), the caller being 0. */
typedef void (*pool_task)(void *context, int id, int team);

/* Runs task(context, id, team) on `team` threads (the caller and team - 1 workers) and returns when all
 * have finished; the workers then stay awake for `spin_ns` (another job soon: a decode step's next MoE
 * layer on a GPU host) before they sleep. Jobs from several threads run one after another. */
void pool_run(int team, pool_task task, void *context, int64_t spin_ns);

/* Pins worker i (1..count) to CPU cpus[i - 1] (-1: unpinned, the caller's own mask), those running and
 * those started later; workers past `count` are not pinned. The caller (id 0) is never pinned. */
void pool_pin(const int32_t *cpus, int count);

/* Claims the next unit of a shared counter (dynamic scheduling): < limit while work remains. */
int64_t pool_claim(int64_t *counter);

/* A spin-wait hint to the core. */
static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Turn `turn` (1, 2, ...) of a busy wait: a pause, and at every 1,024th a yield (more threads than cores, a
 * caller's choice: let the thread waited for run). */
static inline void pool_relax(unsigned turn) {
    pool_pause();
    if (turn % 1024 == 0) sched_yield();
}

static inline int64_t pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#endif
