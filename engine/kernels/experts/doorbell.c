/* A doorbell the device rings for a decode step's host steps, instead of a CUDA host function.
 *
 * A host function (cuLaunchHostFunc) runs on the driver's own thread, which sleeps between calls: each MoE
 * layer of a hybrid decode step paid its wake-up and the driver's bookkeeping, ~46 us a layer on the H200
 * host, ~2 ms of a 45-layer step. Here the device writes a word in pinned memory (a stream memory
 * operation, captured in the step's graph like a kernel), a listener thread that spins between layers sees
 * it, runs that layer's host step and writes the answer word the device's stream waits on.
 *
 * The words (32-bit, device-mapped pinned memory the caller owns):
 *   ring: 0, or 1 + the index of the host step to run (table[index] is its host_step_args); the device
 *         writes it, the listener clears it when it takes the step.
 *   done: the ring value of the last step whose output is in place; the device clears it before it rings
 *         (a one-layer model rings the same value every step) and then waits until it equals its ring.
 * The listener spins for spin_ns after its last step (a decode step's next layer comes a few hundred
 * microseconds later), then sleeps in short naps; doorbell_arm (called before each step) wakes it at once.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "thread_pool.h"

void host_step(void *arg); /* cpu_gemv.c */

#define NAP_NS 1000000 /* asleep, the listener still looks every millisecond: a ring never waits longer */

typedef struct {
    _Atomic uint32_t *ring, *done;
    const int64_t *table; /* host_step_args addresses, by index */
    int64_t spin_ns;
    _Atomic uint32_t armed; /* futex word: bumped by doorbell_arm */
    _Atomic int napping, stop;
    pthread_t thread;
} doorbell;

static void *listen_for_rings(void *arg) {
    doorbell *b = arg;
    const struct timespec nap = {0, NAP_NS};
    uint32_t armed = atomic_load(&b->armed);
    int64_t idle_since = 0;
    for (unsigned turn = 1; !atomic_load_explicit(&b->stop, memory_order_relaxed); turn++) {
        const uint32_t rung = atomic_load_explicit(b->ring, memory_order_acquire);
        if (rung) {
            atomic_store_explicit(b->ring, 0, memory_order_relaxed);
            host_step((void *)(uintptr_t)b->table[rung - 1]);
            atomic_store_explicit(b->done, rung, memory_order_release);
            idle_since = 0;
            continue;
        }
        if (!idle_since || pool_now_ns() - idle_since < b->spin_ns) {
            pool_pause();
            if (!idle_since && turn % 1024 == 0) idle_since = pool_now_ns();
            continue;
        }
        /* Idle past the spin: nap until armed (or a millisecond, then look at the ring again). */
        atomic_store(&b->napping, 1);
        if (atomic_load(&b->armed) == armed)
            syscall(SYS_futex, (uint32_t *)&b->armed, FUTEX_WAIT_PRIVATE, armed, &nap, NULL, 0);
        atomic_store(&b->napping, 0);
        const uint32_t now = atomic_load(&b->armed);
        if (now != armed) armed = now, idle_since = 0; /* a step is coming: spin again */
    }
    return NULL;
}

/* Starts a listener on these words; NULL if its thread cannot start. */
void *doorbell_open(uint32_t *ring, uint32_t *done, const int64_t *table, int64_t spin_ns) {
    doorbell *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->ring = (_Atomic uint32_t *)ring, b->done = (_Atomic uint32_t *)done, b->table = table, b->spin_ns = spin_ns;
    if (pthread_create(&b->thread, NULL, listen_for_rings, b)) {
        free(b);
        return NULL;
    }
    pthread_setname_np(b->thread, "glmflash-bell");
    return b;
}

/* A step is about to run: wake the listener if it naps. */
void doorbell_arm(void *bell) {
    doorbell *b = bell;
    atomic_fetch_add(&b->armed, 1);
    if (atomic_load(&b->napping)) syscall(SYS_futex, (uint32_t *)&b->armed, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* Stops and joins the listener (no ring may be pending: the device work that rings it has finished). */
void doorbell_close(void *bell) {
    doorbell *b = bell;
    atomic_store(&b->stop, 1);
    doorbell_arm(b);
    pthread_join(b->thread, NULL);
    free(b);
}
