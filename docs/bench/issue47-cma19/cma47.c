// Issue 47, helper C (nineteenth): is a CMA all_reduce clearly under 1.3x the floor?
// Build: gcc -O3 -o cma47 cma47.c; run: ./cma47 floor|copyin|cma WORLD ITERS [CHUNK_KIB].
// Standalone, not the project's code. 8 processes (fork), one shared mapping for phase lines
// and slots, private 1 MiB f32 buffers. Modes:
//   floor  : dissemination barrier + copy of 2(N-1)/N MiB through 1 MiB buffers (the bench's)
//   copyin : today's arena shape: copy the N-1 others' shares into my slot, publish, fold my
//            share from every slot (4 KiB blocks), write it to my out slot + my buffer,
//            publish, copy the N-1 reduced shares out.
//   cma    : publish my buffer's address; fold my share reading each peer's share straight
//            from its buffer with process_vm_readv (chunk bytes at a time), write it to my out
//            slot (+ my buffer in place), publish, copy the N-1 reduced shares out.
// Rank 0's per-call times after a warm-up; median printed (us). Waits: poll with sched_yield.
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1 << 20)
#define MAXW 64

struct line {
    _Atomic uint64_t phase;
    _Atomic uint64_t addr;
    _Atomic int32_t pid;
    char pad[64 - 20];
};

static int W, me;
static struct line *lines;
static char *in_slots, *out_slots; // W MiB each
static size_t chunk = 32 << 10;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void publish(uint64_t p) { atomic_store_explicit(&lines[me].phase, p, memory_order_release); }

static double *work_shared; // per rank: CPU us spent outside waits, timed calls
static double work_acc, work_t0;
static int timing;
static double cpu_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static void wait_all(uint64_t p) {
    if (timing) work_acc += cpu_us() - work_t0;
    for (int j = 0; j < W; j++)
        while (atomic_load_explicit(&lines[j].phase, memory_order_acquire) < p) sched_yield();
    if (timing) work_t0 = cpu_us();
}

static void fold(float *restrict dst, const float *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

static size_t share_off(int s) { return (size_t)s * (MIB / 4 / W) * 4; }
static size_t share_len(int s) { return (s == W - 1 ? MIB : share_off(s + 1)) - share_off(s); }

// today's shape
static void ar_copyin(char *buf, uint64_t *phase) {
    char *mine = in_slots + (size_t)me * MIB;
    for (int s = 0; s < W; s++)
        if (s != me) memcpy(mine + share_off(s), buf + share_off(s), share_len(s));
    publish(++*phase);
    wait_all(*phase);
    // fold my share: 4 KiB blocks through a scratch block, own input first
    static float block[1024];
    size_t off = share_off(me), len = share_len(me);
    for (size_t b = 0; b < len; b += 4096) {
        size_t n = len - b < 4096 ? len - b : 4096;
        memcpy(block, buf + off + b, n);
        for (int j = 0; j < W; j++)
            if (j != me) fold(block, (float *)(in_slots + (size_t)j * MIB + off + b), n / 4);
        memcpy(buf + off + b, block, n);
        memcpy(out_slots + (size_t)me * MIB + off + b, block, n);
    }
    publish(++*phase);
    wait_all(*phase);
    for (int s = 0; s < W; s++)
        if (s != me) memcpy(buf + share_off(s), out_slots + (size_t)s * MIB + share_off(s), share_len(s));
}

static char *tmp;

static void ar_cma(char *buf, uint64_t *phase) {
    atomic_store_explicit(&lines[me].addr, (uint64_t)(uintptr_t)buf, memory_order_relaxed);
    publish(++*phase);
    wait_all(*phase);
    size_t off = share_off(me), len = share_len(me);
    for (size_t b = 0; b < len; b += chunk) {
        size_t n = len - b < chunk ? len - b : chunk;
        for (int j = 0; j < W; j++) {
            if (j == me) continue;
            struct iovec l = {tmp, n};
            struct iovec r = {(void *)(uintptr_t)(atomic_load(&lines[j].addr) + off + b), n};
            ssize_t got = process_vm_readv(lines[j].pid, &l, 1, &r, 1, 0);
            if (got != (ssize_t)n) {
                fprintf(stderr, "rank %d: process_vm_readv from %d: %zd (%s)\n", me, j, got, strerror(errno));
                exit(3);
            }
            fold((float *)(buf + off + b), (float *)tmp, n / 4);
        }
        memcpy(out_slots + (size_t)me * MIB + off + b, buf + off + b, n);
    }
    publish(++*phase);
    wait_all(*phase);
    for (int s = 0; s < W; s++)
        if (s != me) memcpy(buf + share_off(s), out_slots + (size_t)s * MIB + share_off(s), share_len(s));
}

// the bench's floor: dissemination barrier, then copy 2(N-1)/N MiB through 1 MiB buffers

static void floor_iter(char *src, char *dst, uint64_t *phase) {
    // a barrier through the phase lines (every rank waits for all): same sync as one phase
    publish(++*phase);
    wait_all(*phase);
    size_t left = (size_t)2 * (W - 1) * MIB / W;
    while (left) {
        size_t n = left < MIB ? left : MIB;
        memcpy(dst, src, n);
        __asm__ volatile("" ::"r"(dst) : "memory");
        left -= n;
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: cma47 floor|copyin|cma WORLD ITERS [CHUNK_KIB]\n");
        return 2;
    }
    const char *mode = argv[1];
    W = atoi(argv[2]);
    int iters = atoi(argv[3]);
    if (argc > 4) chunk = (size_t)atoi(argv[4]) << 10;
    size_t ctl = sizeof(struct line) * MAXW;
    char *shm = mmap(NULL, ctl + 2 * (size_t)W * MIB, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shm == MAP_FAILED) return 1;
    lines = (struct line *)shm;
    in_slots = shm + ctl;
    out_slots = in_slots + (size_t)W * MIB;
    memset(in_slots, 0, 2 * (size_t)W * MIB);
    work_shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    me = 0;
    for (int r = 1; r < W; r++) {
        pid_t p = fork();
        if (p == 0) { me = r; break; }
    }
    atomic_store(&lines[me].pid, getpid());
    char *buf = aligned_alloc(4096, MIB), *src = aligned_alloc(4096, MIB);
    tmp = aligned_alloc(4096, chunk < MIB ? MIB : chunk);
    for (size_t i = 0; i < MIB / 4; i++) ((float *)buf)[i] = (float)(i % 7);
    memcpy(src, buf, MIB);
    memset(tmp, 0, chunk < MIB ? MIB : chunk);
    uint64_t phase = 0;
    publish(++phase);
    wait_all(phase); // pids known
    int warm = iters / 10 < 3 ? 3 : iters / 10;
    double *t = malloc(sizeof(double) * iters);
    for (int i = -warm; i < iters; i++) {
        if (i == 0) { publish(++phase); wait_all(phase); }
        double t0 = now_us();
        timing = i >= 0;
        work_t0 = cpu_us();
        if (!strcmp(mode, "floor")) floor_iter(src, buf, &phase);
        else if (!strcmp(mode, "copyin")) ar_copyin(buf, &phase);
        else if (!strcmp(mode, "cma")) ar_cma(buf, &phase);
        else return 2;
        if (i >= 0) t[i] = now_us() - t0;
        if (timing) work_acc += cpu_us() - work_t0;
        timing = 0;
    }
    // check: a fresh sum after (W^calls growth): check one call on known data
    for (size_t i = 0; i < MIB / 4; i++) ((float *)buf)[i] = (float)(i % 7) + me;
    publish(++phase); wait_all(phase);
    if (!strcmp(mode, "copyin")) ar_copyin(buf, &phase);
    else if (!strcmp(mode, "cma")) ar_cma(buf, &phase);
    if (strcmp(mode, "floor")) {
        for (size_t i = 0; i < MIB / 4; i++) {
            float want = (float)W * (float)(i % 7) + (float)(W * (W - 1) / 2);
            if (((float *)buf)[i] != want) {
                fprintf(stderr, "rank %d: element %zu is %f, not %f\n", me, i, ((float *)buf)[i], want);
                exit(4);
            }
        }
    }
    work_shared[me] = work_acc / iters;
    publish(++phase); wait_all(phase);
    if (me != 0) return 0;
    for (int r = 1; r < W; r++) {
        int st;
        wait(&st);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "a rank failed\n"); return 1; }
    }
    double wsum = 0;
    for (int r = 0; r < W; r++) wsum += work_shared[r];
    qsort(t, iters, sizeof(double), cmp);
    printf("%s w%d chunk %zuKiB: median %.1f us (p10 %.1f, p90 %.1f); work CPU per call, all ranks %.1f us\n", mode, W,
           chunk >> 10, t[iters / 2], t[iters / 10], t[iters * 9 / 10], wsum);
    return 0;
}
