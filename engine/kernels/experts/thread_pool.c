/* A persistent pool of worker threads for the CPU expert kernels, apart from torch's and OpenMP's.
 *
 * Fork-join: the caller publishes a job by bumping a generation counter, works as thread 0, and waits
 * until every worker has acknowledged the job. After a job, workers spin for as long as the job asked
 * before they sleep on a futex: on a GPU host a decode step's MoE layers come a few hundred microseconds
 * apart (the device's share of each layer), and waking sleeping threads for each of them cost a third of
 * a layer's CPU time; without a GPU, torch runs the rest of the model on the same cores between expert
 * passes, and spinning workers would take them from it. An idle server never burns its cores.
 * Workers are named `glmflash-expert` and may be pinned to cores (pool_pin; the caller picks the cores).
 * OpenMP could spin too, but its wait policy is process-wide: torch's intra-op threads share the
 * runtime, and with both teams spinning on the same cores the expert pass ran 7x slower (measured on
 * the H200 host). Linux only (futex); elsewhere the extension is not built and the torch path runs.
 */
#define _GNU_SOURCE
#include "thread_pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_WORKERS 255

static struct {
    pthread_mutex_t submit; /* one job at a time */
    int workers;            /* started, ids 1..workers */
    _Atomic uint32_t generation;
    _Atomic int sleepers;
    _Atomic int pending; /* workers yet to acknowledge the current job */
    pool_task task;      /* the current job: workers with id < team run it */
    void *context;
    int team;
    int64_t spin_ns;
    pthread_t threads[MAX_WORKERS + 1]; /* by worker id */
    int32_t pinned[MAX_WORKERS + 1];    /* by worker id: 1 + the CPU it is pinned to, 0 when it is not */
} pool = {.submit = PTHREAD_MUTEX_INITIALIZER};

/* Applies worker `id`'s entry of the pin table (none: the caller's own mask, undoing an earlier pin). */
static void place(int id) {
    cpu_set_t set;
    const int32_t cpu = pool.pinned[id] - 1;
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
        if (pthread_getaffinity_np(pthread_self(), sizeof set, &set)) return;
    } else {
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
    }
    pthread_setaffinity_np(pool.threads[id], sizeof set, &set); /* a CPU outside the cgroup: stays unpinned */
}

static void futex(_Atomic uint32_t *word, int op, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, op, value, NULL, NULL, 0);
}

/* Returns the generation once it differs from `seen`: spinning for `spin_ns` at first, then asleep. */
static uint32_t next_job(uint32_t seen, int64_t spin_ns) {
    int64_t since = 0;
    for (unsigned spins = 1;; spins++) {
        const uint32_t now = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (now != seen) return now;
        pool_pause();
        if (spin_ns && spins % 1024) continue;
        sched_yield(); /* more threads than cores (a caller's choice): let a preempted one finish its share */
        if (!since) {
            since = pool_now_ns();
        } else if (pool_now_ns() - since >= spin_ns) {
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen) futex(&pool.generation, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&pool.sleepers, 1);
            since = 0;
        }
    }
}

/* arg: the worker's id in the low 16 bits, above them the generation it was started at (a worker that
 * starts after the job it was started for was published must still take part in it). */
static void *worker(void *arg) {
    const int id = (int)((uintptr_t)arg & 0xffff);
    uint32_t seen = (uint32_t)((uintptr_t)arg >> 16);
    int64_t spin_ns = 0;
    for (;;) {
        seen = next_job(seen, spin_ns);
        spin_ns = pool.spin_ns;
        if (id < pool.team) pool.task(pool.context, id, pool.team);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own when it first needs them. */
static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.submit, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static void grow(int workers) {
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, after_fork_in_child);
    while (pool.workers < workers && pool.workers < MAX_WORKERS) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = (uintptr_t)(pool.workers + 1) | (uintptr_t)atomic_load(&pool.generation) << 16;
        const int failed = pthread_create(&thread, &attr, worker, (void *)arg);
        pthread_attr_destroy(&attr);
        if (failed) break; /* run with the workers there are */
        pool.workers++;
        pool.threads[pool.workers] = thread;
        pthread_setname_np(thread, "glmflash-expert");
        if (pool.pinned[pool.workers]) place(pool.workers);
    }
}

void pool_run(int team, pool_task task, void *context, int64_t spin_ns) {
    if (team <= 1) {
        task(context, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.submit);
    grow(team - 1);
    pool.task = task, pool.context = context, pool.spin_ns = spin_ns;
    pool.team = team < pool.workers + 1 ? team : pool.workers + 1;
    atomic_store(&pool.pending, pool.workers);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers)) futex(&pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX);
    task(context, 0, pool.team);
    for (unsigned turn = 1; atomic_load_explicit(&pool.pending, memory_order_acquire); turn++) pool_relax(turn);
    pthread_mutex_unlock(&pool.submit);
}

void pool_pin(const int32_t *cpus, int count) {
    pthread_mutex_lock(&pool.submit);
    for (int id = 1; id <= MAX_WORKERS; id++) {
        const int32_t before = pool.pinned[id];
        pool.pinned[id] = id <= count && cpus[id - 1] >= 0 ? cpus[id - 1] + 1 : 0;
        if (id <= pool.workers && (pool.pinned[id] || before)) place(id);
    }
    pthread_mutex_unlock(&pool.submit);
}

int64_t pool_claim(int64_t *counter) {
    return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}
