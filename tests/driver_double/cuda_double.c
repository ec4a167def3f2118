/* A test double of the CUDA driver for machines without a GPU.
 *
 * It exports the driver entry points ppnrt uses, so that the crate loads it through
 * PPNRT_LIBCUDA_PATH exactly as it loads libcuda.so.1. What it models, and why:
 *
 * - Devices (PPNRT_DOUBLE_DEVICES, default 2) with one primary context each. Device memory is host
 *   memory; a device pointer is its host address (unified addressing).
 * - Stream work is deferred: copies, memsets, kernels, event records, waits and stream-ordered
 *   frees are queued per stream and run only when something synchronises (a stream, event or
 *   context synchronisation, a query, or a pageable device-to-host copy), and then only as much
 *   as that synchronisation needs. Work that nothing orders therefore runs as late as possible:
 *   a missing wait shows up as a wrong value or a use-after-free, deterministically.
 * - Pageable host memory is staged at the call, as the real driver does; pinned host memory
 *   (cuMemHostAlloc) is read or written when the copy runs.
 * - Freed memory (cuMemFree, cuMemFreeAsync when it runs, cuMemFreeHost) is poisoned and kept in
 *   quarantine; any queued work that touches it, or an address that was never allocated, is a
 *   violation: counted, described on stderr, and for kernels the context dies with
 *   CUDA_ERROR_ILLEGAL_ADDRESS (sticky), as on a GPU. A kernel that reaches another device's
 *   memory needs peer access enabled and memory that is not from a pool.
 * - The helper kernels of kernels/ run as C twins (bit for bit: fmaf is exactly rounded).
 * - Fault injection: ppnrt_double_fail(entry, nth, code) makes the nth next call of `entry`
 *   return `code`; PPNRT_DOUBLE_FAIL="entry:nth[:code],..." does the same from the start.
 * - PPNRT_DOUBLE_NO_POOLS=1: devices without memory pools (cuMemAllocAsync is not supported).
 *   PPNRT_DOUBLE_NO_PEER=1: no peer access. PPNRT_DOUBLE_VERSION: the reported driver version.
 *   Built with -DPPNRT_DOUBLE_CUDA_12_4 it reports 12.4 and lacks the entry points that came
 *   later (cuEventElapsedTime_v2), as an older driver does.
 *
 * One mutex guards all state: every entry point is atomic with respect to the others. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_PEER_ACCESS_UNSUPPORTED = 217,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_ILLEGAL_ADDRESS = 700,
    E_PEER_ACCESS_ALREADY_ENABLED = 704,
    E_LAUNCH_FAILED = 719,
    E_NOT_SUPPORTED = 801,
    E_CAPTURE_UNSUPPORTED = 900,
    E_CAPTURE_INVALIDATED = 901,
    E_CAPTURE_ISOLATION = 905,
    E_GRAPH_EXEC_UPDATE_FAILURE = 910,
    E_UNKNOWN = 999,
};

#define MAX_DEVICES 8
#define QUARANTINE_BYTES (64u << 20)

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                      */

typedef struct Ctx {
    int device;
    int refcount;
    int dead; /* sticky error code, 0 when usable */
    int peer[MAX_DEVICES];
    struct Stream* legacy;
} Ctx;

enum { MEM_DEVICE = 1, MEM_PINNED = 2 };

typedef struct Alloc {
    uintptr_t base;
    size_t size;
    int kind;
    int device;
    int pooled;
    int freed;
    struct Alloc* next;
} Alloc;

enum { OP_COPY, OP_SET8, OP_SET32, OP_KERNEL, OP_RECORD, OP_WAIT, OP_FREE_ASYNC, OP_EXTERNAL };

typedef struct Stream Stream;
typedef struct Event Event;

typedef struct Op {
    int kind;
    int src_host, dst_host; /* the side may be pageable host memory */
    CUdeviceptr dst, src;
    size_t bytes;
    unsigned char* staged; /* pageable source copied at the call */
    unsigned value;
    int kernel;
    unsigned long long params[8];
    Event* event;
    unsigned long long generation;
    Stream* target;
    size_t target_pos;
    Event* wait_event; /* in a graph: an external event wait, resolved at each launch */
    /* OP_EXTERNAL: work of another library's (the NCCL double's send or receive): it runs when
     * `ready` says it can; until then the stream waits there, with the lock released. */
    int (*ready)(void*);
    void (*run)(void*);
    void* arg;
} Op;

/* A captured graph, and an instantiated one: the ops recorded by a capture, in stream order. */
typedef struct Graph {
    Ctx* ctx;
    Op* ops;
    size_t len, cap;
} Graph;

struct Stream {
    int polls; /* queries since work last ran: the device progresses under repeated polling */
    Ctx* ctx;
    Op* ops;
    size_t len, cap, head;
    int destroyed;
    Graph* capture;       /* the graph being captured, NULL when not capturing */
    int capture_invalid;  /* a call that cannot be captured was made: ending fails */
    /* A capture's begin or end is in progress on some thread (see capture_transition): the real
     * driver hangs or crashes when another thread enqueues on the stream meanwhile. */
    int in_transition;
};

struct Event {
    int polls;
    Ctx* ctx;
    Stream* stream;
    size_t pos;
    unsigned long long generation, done_generation;
    double time_ms;
    int timing, recorded, destroyed;
    /* Last recorded into a capture (a capture-internal event): a wait on it from a stream not
     * capturing would join that stream into the capture, a query or synchronisation is refused by
     * the driver. Both are violations here; recording it again outside a capture clears this. */
    int in_capture;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int n_devices = 2;
static int no_pools, no_peer;
#ifdef PPNRT_DOUBLE_CUDA_12_4
static int driver_version = 12040;
#else
static int driver_version = 13000;
#endif
static Ctx ctxs[MAX_DEVICES];
static Alloc* allocs;
static size_t quarantined;
static Stream** streams;
static size_t n_streams, cap_streams;
static double clock_ms;
static unsigned long long violations;
static char last_violation[512];
static __thread Ctx* current;

typedef struct Fault {
    char entry[64];
    int countdown;
    int code;
} Fault;
static Fault faults[16];

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                    */

static void violation(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_violation, sizeof last_violation, fmt, args);
    va_end(args);
    violations++;
    fprintf(stderr, "ppnrt-driver-double: VIOLATION: %s\n", last_violation);
}

static void init_from_env(void) {
    const char* v = getenv("PPNRT_DOUBLE_DEVICES");
    if (v) {
        n_devices = atoi(v);
        if (n_devices < 0) n_devices = 0;
        if (n_devices > MAX_DEVICES) n_devices = MAX_DEVICES;
    }
    no_pools = getenv("PPNRT_DOUBLE_NO_POOLS") && strcmp(getenv("PPNRT_DOUBLE_NO_POOLS"), "1") == 0;
    no_peer = getenv("PPNRT_DOUBLE_NO_PEER") && strcmp(getenv("PPNRT_DOUBLE_NO_PEER"), "1") == 0;
    v = getenv("PPNRT_DOUBLE_VERSION");
    if (v) driver_version = atoi(v);
    for (int d = 0; d < MAX_DEVICES; d++) ctxs[d].device = d;
    v = getenv("PPNRT_DOUBLE_FAIL");
    if (v) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", v);
        char* save = NULL;
        for (char* item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
            char name[64] = {0};
            int nth = 1, code = E_OUT_OF_MEMORY;
            if (sscanf(item, "%63[^:]:%d:%d", name, &nth, &code) >= 1) {
                for (int i = 0; i < 16; i++)
                    if (!faults[i].entry[0]) {
                        snprintf(faults[i].entry, sizeof faults[i].entry, "%s", name);
                        faults[i].countdown = nth;
                        faults[i].code = code;
                        break;
                    }
            }
        }
    }
}

/* The injected result for a call of `entry`, or OK. */
static CUresult injected(const char* entry) {
    for (int i = 0; i < 16; i++) {
        if (faults[i].entry[0] && strcmp(faults[i].entry, entry) == 0) {
            if (--faults[i].countdown == 0) {
                int code = faults[i].code;
                faults[i].entry[0] = 0;
                return code;
            }
        }
    }
    return OK;
}

/* Calls per entry point, for tests that count what an operation costs in driver calls. */
typedef struct CallCount {
    const char* name;
    unsigned long long calls;
} CallCount;
static CallCount call_counts[96];

static void count_call(const char* name) {
    for (size_t i = 0; i < sizeof call_counts / sizeof call_counts[0]; i++) {
        if (call_counts[i].name == name || (call_counts[i].name && strcmp(call_counts[i].name, name) == 0)) {
            call_counts[i].calls++;
            return;
        }
        if (!call_counts[i].name) {
            call_counts[i].name = name;
            call_counts[i].calls = 1;
            return;
        }
    }
}

/* Calls of `entry` so far (0 for one never called). */
unsigned long long ppnrt_double_calls(const char* entry) {
    pthread_mutex_lock(&lock);
    unsigned long long n = 0;
    for (size_t i = 0; i < sizeof call_counts / sizeof call_counts[0] && call_counts[i].name; i++)
        if (strcmp(call_counts[i].name, entry) == 0) n = call_counts[i].calls;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The name of the i-th entry point called so far (in order of first call) into buf
 * (NUL-terminated); -1 past the last. */
int ppnrt_double_entry_called(size_t i, char* buf, size_t len) {
    pthread_mutex_lock(&lock);
    int rc = -1;
    if (i < sizeof call_counts / sizeof call_counts[0] && call_counts[i].name) {
        snprintf(buf, len, "%s", call_counts[i].name);
        rc = 0;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

#define ENTER(name)                              \
    pthread_mutex_lock(&lock);                   \
    count_call(name);                            \
    CUresult _injected = injected(name);         \
    if (_injected != OK) RETURN(_injected);      \
    if (!initialized && strcmp(name, "cuInit") != 0 && strcmp(name, "cuDriverGetVersion") != 0 && \
        strcmp(name, "cuGetErrorName") != 0 && strcmp(name, "cuGetErrorString") != 0) \
        RETURN(E_NOT_INITIALIZED)
#define RETURN(code)                  \
    do {                              \
        CUresult _rc = (code);        \
        pthread_mutex_unlock(&lock);  \
        return _rc;                   \
    } while (0)

static Alloc* find_alloc(uintptr_t p, size_t bytes, int include_freed) {
    for (Alloc* a = allocs; a; a = a->next) {
        if (!include_freed && a->freed) continue;
        if (p >= a->base && p < a->base + (a->size ? a->size : 1)) {
            (void)bytes;
            return a;
        }
    }
    return NULL;
}

static Alloc* new_alloc(size_t bytes, int kind, int device, int pooled) {
    size_t size = bytes ? bytes : 1;
    void* mem = aligned_alloc(kind == MEM_PINNED ? 4096 : 256, (size + 4095) & ~(size_t)4095);
    if (!mem) return NULL;
    memset(mem, 0xA5, size); /* fresh device memory holds garbage, not zeros */
    Alloc* a = calloc(1, sizeof *a);
    a->base = (uintptr_t)mem;
    a->size = size;
    a->kind = kind;
    a->device = device;
    a->pooled = pooled;
    a->next = allocs;
    allocs = a;
    return a;
}

/* Poisons and quarantines an allocation; releases the oldest quarantined ones past a budget. */
static void free_alloc(Alloc* a) {
    a->freed = 1;
    memset((void*)a->base, 0xDB, a->size);
    quarantined += a->size;
    while (quarantined > QUARANTINE_BYTES) {
        Alloc **oldest = NULL, **pp = &allocs;
        for (; *pp; pp = &(*pp)->next)
            if ((*pp)->freed) oldest = pp;
        if (!oldest) break;
        Alloc* victim = *oldest;
        *oldest = victim->next;
        quarantined -= victim->size;
        free((void*)victim->base);
        free(victim);
    }
}

/* Checks that [p, p+bytes) lies in one live allocation. `who` names the operation. Returns the
 * allocation, or NULL after recording a violation. */
static Alloc* check_range(const char* who, CUdeviceptr p, size_t bytes) {
    Alloc* a = find_alloc((uintptr_t)p, bytes, 1);
    if (!a) {
        violation("%s: address %#llx (%zu bytes) was never allocated (or was released long ago)", who, p, bytes);
        return NULL;
    }
    if (a->freed) {
        violation("%s: address %#llx (%zu bytes) is in freed memory (allocation %#lx, %zu bytes)", who, p, bytes,
                  (unsigned long)a->base, a->size);
        return NULL;
    }
    if ((uintptr_t)p + bytes > a->base + a->size) {
        violation("%s: range %#llx+%zu overruns its allocation (%#lx, %zu bytes)", who, p, bytes,
                  (unsigned long)a->base, a->size);
        return NULL;
    }
    return a;
}

/* Whether a kernel on `ctx`'s device may touch allocation `a`. */
static int reachable_from(Ctx* ctx, Alloc* a) {
    if (a->kind == MEM_PINNED) return 1;
    if (a->device == ctx->device) return 1;
    return ctx->peer[a->device] && !a->pooled;
}

static Stream* stream_of(void* handle) {
    if (handle) return (Stream*)handle;
    if (!current) return NULL;
    if (!current->legacy) {
        Stream* s = calloc(1, sizeof *s);
        s->ctx = current;
        current->legacy = s;
    }
    return current->legacy;
}

static void graph_push(Graph* g, Op op) {
    if (g->len == g->cap) {
        g->cap = g->cap ? g->cap * 2 : 16;
        g->ops = realloc(g->ops, g->cap * sizeof(Op));
    }
    g->ops[g->len++] = op;
}

/* A call that cannot be captured, made on a capturing stream: the capture is invalidated, as the
 * driver does. */
static CUresult refuse_capture(Stream* s) {
    s->capture_invalid = 1;
    return E_CAPTURE_UNSUPPORTED;
}

static void push(Stream* s, Op op) {
    if (s->in_transition) {
        violation("an enqueue on a stream while another thread began or ended its capture (the driver hangs or "
                  "crashes on this)");
    }
    if (s->capture) {
        /* Captured, not queued: it runs at each launch of the graph. */
        graph_push(s->capture, op);
        return;
    }
    if (s->len == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 64;
        s->ops = realloc(s->ops, s->cap * sizeof(Op));
    }
    s->ops[s->len++] = op;
}

/* ------------------------------------------------------------------------------------------ */
/* Kernels: C twins of the kernels/ sources                                                         */

enum { K_FILL_PATTERN = 1, K_FILL_U32, K_CHECKSUM, K_SPIN, K_COPY_BYTES, K_TRAP, K_TOY_LAYER };
static const struct {
    const char* name;
    int id;
    int n_params;
    int param_size[8];
} kernels[] = {
    {"ppnrt_fill_pattern_u32", K_FILL_PATTERN, 3, {8, 8, 4}},
    {"ppnrt_fill_u32", K_FILL_U32, 3, {8, 8, 4}},
    {"ppnrt_checksum_u32", K_CHECKSUM, 3, {8, 8, 8}},
    {"ppnrt_spin_ns", K_SPIN, 1, {8}},
    {"ppnrt_copy_bytes", K_COPY_BYTES, 4, {8, 8, 8, 8}},
    {"ppnrt_trap", K_TRAP, 0, {0}},
    {"ppnrt_toy_layer_f32", K_TOY_LAYER, 4, {8, 8, 4, 4}},
};
#define N_KERNELS (sizeof kernels / sizeof kernels[0])

static uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

static uint32_t pattern(uint32_t seed, uint64_t i) {
    return mix32(seed ^ mix32((uint32_t)i ^ mix32((uint32_t)(i >> 32) + 0x9e3779b9u)));
}

/* Checks a kernel's pointer argument: live, in range, reachable from the launching device. */
static int kernel_range(Ctx* ctx, const char* name, CUdeviceptr p, size_t bytes) {
    if (bytes == 0) return 1;
    Alloc* a = check_range(name, p, bytes);
    if (!a) return 0;
    if (!reachable_from(ctx, a)) {
        violation("%s on device %d: %#llx is memory of device %d that it cannot reach (%s)", name, ctx->device, p,
                  a->device, a->pooled ? "pool memory is not peer-mapped" : "peer access is not enabled");
        return 0;
    }
    return 1;
}

static void run_kernel(Stream* s, Op* op) {
    Ctx* ctx = s->ctx;
    unsigned long long* p = op->params;
    switch (op->kernel) {
    case K_FILL_PATTERN:
    case K_FILL_U32: {
        uint32_t* dst = (uint32_t*)(uintptr_t)p[0];
        uint64_t n = p[1];
        uint32_t v = (uint32_t)p[2];
        if (!kernel_range(ctx, op->kernel == K_FILL_U32 ? "ppnrt_fill_u32" : "ppnrt_fill_pattern_u32", p[0], n * 4))
            goto illegal;
        for (uint64_t i = 0; i < n; i++) dst[i] = op->kernel == K_FILL_U32 ? v : pattern(v, i);
        break;
    }
    case K_CHECKSUM: {
        const uint32_t* src = (const uint32_t*)(uintptr_t)p[0];
        uint64_t n = p[1];
        if (!kernel_range(ctx, "ppnrt_checksum_u32", p[0], n * 4) ||
            !kernel_range(ctx, "ppnrt_checksum_u32 (out)", p[2], 8))
            goto illegal;
        unsigned long long sum = 0;
        for (uint64_t i = 0; i < n; i++) sum += mix32(src[i] + 0x9e3779b9u * (uint32_t)i);
        *(unsigned long long*)(uintptr_t)p[2] += sum;
        break;
    }
    case K_SPIN:
        clock_ms += (double)p[0] / 1e6;
        break;
    case K_COPY_BYTES: {
        size_t bytes = (size_t)(p[2] * 16 + p[3]);
        if (!kernel_range(ctx, "ppnrt_copy_bytes (dst)", p[0], bytes) ||
            !kernel_range(ctx, "ppnrt_copy_bytes (src)", p[1], bytes))
            goto illegal;
        memmove((void*)(uintptr_t)p[0], (const void*)(uintptr_t)p[1], bytes);
        break;
    }
    case K_TRAP:
        ctx->dead = E_LAUNCH_FAILED;
        break;
    case K_TOY_LAYER: {
        float* x = (float*)(uintptr_t)p[0];
        uint64_t n = p[1];
        uint32_t step = (uint32_t)p[2], layer = (uint32_t)p[3];
        if (!kernel_range(ctx, "ppnrt_toy_layer_f32", p[0], n * 4)) goto illegal;
        uint32_t key = mix32(step * 0x9e3779b9u ^ mix32(layer + 0x7f4a7c15u));
        for (uint64_t i = 0; i < n; i++) {
            uint32_t h = mix32(key ^ (uint32_t)i);
            float a = 0.5f + (float)(h >> 8) * (0.5f / 16777216.0f);
            float b = (float)(mix32(h) >> 8) * (1.0f / 16777216.0f) - 0.5f;
            x[i] = fmaf(x[i], a, b);
        }
        break;
    }
    }
    clock_ms += 0.001;
    return;
illegal:
    ctx->dead = E_ILLEGAL_ADDRESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Execution                                                                                  */

static int run_until(Stream* s, size_t pos);

static void execute(Stream* s, Op* op) {
    if (s->ctx->dead && op->kind != OP_RECORD && op->kind != OP_WAIT) return;
    switch (op->kind) {
    case OP_COPY: {
        if (op->bytes == 0) break;
        int ok = 1;
        /* A host side that is no allocation is pageable memory: staged at the call (source) or
         * copied at the call (destination), while the caller's buffer lives. */
        if (!op->staged && !(op->src_host && !find_alloc((uintptr_t)op->src, 1, 1)))
            ok = check_range("copy source", op->src, op->bytes) != NULL;
        if (!(op->dst_host && !find_alloc((uintptr_t)op->dst, 1, 1)))
            ok = check_range("copy destination", op->dst, op->bytes) != NULL && ok;
        if (ok)
            memmove((void*)(uintptr_t)op->dst, op->staged ? op->staged : (const void*)(uintptr_t)op->src, op->bytes);
        free(op->staged);
        op->staged = NULL;
        clock_ms += 0.001 + (double)op->bytes / 4e8;
        break;
    }
    case OP_SET8:
        if (check_range("cuMemsetD8Async", op->dst, op->bytes)) memset((void*)(uintptr_t)op->dst, (int)op->value, op->bytes);
        break;
    case OP_SET32:
        if (check_range("cuMemsetD32Async", op->dst, op->bytes)) {
            uint32_t* w = (uint32_t*)(uintptr_t)op->dst;
            for (size_t i = 0; i < op->bytes / 4; i++) w[i] = op->value;
        }
        break;
    case OP_KERNEL:
        run_kernel(s, op);
        break;
    case OP_RECORD:
        if (op->event->generation == op->generation) op->event->time_ms = clock_ms;
        op->event->done_generation = op->generation;
        break;
    case OP_WAIT:
        break;
    case OP_FREE_ASYNC: {
        Alloc* a = find_alloc((uintptr_t)op->dst, 1, 0);
        if (a) free_alloc(a);
        break;
    }
    case OP_EXTERNAL:
        op->run(op->arg);
        break;
    }
}

/* Runs `s` up to `pos`; 0 when an external operation that is not ready yet stops it there. */
static int run_until(Stream* s, size_t pos) {
    while (s->head < pos) {
        Op* op = &s->ops[s->head];
        if (op->kind == OP_WAIT && !run_until(op->target, op->target_pos)) return 0;
        op = &s->ops[s->head];
        if (op->kind == OP_EXTERNAL && !op->ready(op->arg)) return 0;
        execute(s, op);
        s->head++;
    }
    return 1;
}

/* Lets other threads in for a moment (an external operation waits for another process). */
static void pause_unlocked(void) {
    pthread_mutex_unlock(&lock);
    struct timespec pause = {0, 50000};
    nanosleep(&pause, NULL);
    pthread_mutex_lock(&lock);
}

/* run_until, waiting (the lock released) while an external operation is not ready. */
static void run_until_done(Stream* s, size_t pos) {
    while (!run_until(s, pos)) pause_unlocked();
}

static void run_all(Ctx* only) {
    for (;;) {
        int done = 1;
        for (size_t i = 0; i < n_streams; i++)
            if (!only || streams[i]->ctx == only) done &= run_until(streams[i], streams[i]->len);
        for (int d = 0; d < n_devices; d++)
            if (ctxs[d].legacy && (!only || only == &ctxs[d])) done &= run_until(ctxs[d].legacy, ctxs[d].legacy->len);
        if (done) return;
        pause_unlocked();
    }
}

static int event_complete(Event* e) {
    return !e->stream || e->stream->head >= e->pos;
}

/* ------------------------------------------------------------------------------------------ */
/* Control API for tests                                                                      */

int ppnrt_double_fail(const char* entry, int nth, int code) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 16; i++)
        if (!faults[i].entry[0]) {
            snprintf(faults[i].entry, sizeof faults[i].entry, "%s", entry);
            faults[i].countdown = nth;
            faults[i].code = code;
            pthread_mutex_unlock(&lock);
            return 0;
        }
    pthread_mutex_unlock(&lock);
    return -1;
}

void ppnrt_double_clear_faults(void) {
    pthread_mutex_lock(&lock);
    memset(faults, 0, sizeof faults);
    pthread_mutex_unlock(&lock);
}

unsigned long long ppnrt_double_violations(void) {
    pthread_mutex_lock(&lock);
    unsigned long long v = violations;
    pthread_mutex_unlock(&lock);
    return v;
}

/* Copies the last violation's text into buf (NUL-terminated). */
void ppnrt_double_last_violation(char* buf, size_t len) {
    pthread_mutex_lock(&lock);
    snprintf(buf, len, "%s", last_violation);
    pthread_mutex_unlock(&lock);
}

/* Whether `stream` is being captured, for the NCCL double: whether a call posts into a capture. */
int ppnrt_double_stream_capturing(void* stream) {
    pthread_mutex_lock(&lock);
    Stream* s = stream_of(stream);
    int capturing = s && s->capture != NULL;
    pthread_mutex_unlock(&lock);
    return capturing;
}

/* Enqueues another library's work on `stream` (the NCCL double's sends and receives): `run(arg)`
 * runs in stream order once `ready(arg)` says it can (both called with the double's lock held;
 * neither may call the driver, except `run` ppnrt_double_external_range_ok); captured like any work on a capturing stream, and then run at
 * each launch of the graph with the same `arg`. */
int ppnrt_double_enqueue_external(void* stream, int (*ready)(void*), void (*run)(void*), void* arg) {
    pthread_mutex_lock(&lock);
    Stream* s = stream_of(stream);
    int rc = OK;
    if (!s || s->destroyed) {
        rc = E_INVALID_HANDLE;
    } else if (s->ctx->dead) {
        rc = s->ctx->dead;
    } else {
        Op op = {.kind = OP_EXTERNAL, .ready = ready, .run = run, .arg = arg};
        push(s, op);
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* For another library's operation while it runs (called from its `run`, with the double's lock
 * held): whether [p, p+bytes) lies in one live allocation; a violation, counted and described as
 * for the double's own copies, when it does not. The operation must then leave the memory alone. */
int ppnrt_double_external_range_ok(const char* who, void* p, size_t bytes) {
    return bytes == 0 || check_range(who, (CUdeviceptr)(uintptr_t)p, bytes) != NULL;
}

/* Runs `stream`'s queued work, waiting (unlocked) for external operations: the NCCL double's
 * send runs at once with everything before it, as a GPU makes progress without being asked (a
 * receiver in another process waits for it). */
int ppnrt_double_run_stream(void* stream) {
    pthread_mutex_lock(&lock);
    Stream* s = stream_of(stream);
    if (!s) {
        pthread_mutex_unlock(&lock);
        return E_INVALID_HANDLE;
    }
    if (!s->capture) run_until_done(s, s->len);
    pthread_mutex_unlock(&lock);
    return OK;
}

/* Another library's operations (ppnrt_double_enqueue_external) queued and not yet run, over all
 * streams (those captured into a graph count once a launch queued them). */
unsigned long long ppnrt_double_external_pending(void) {
    pthread_mutex_lock(&lock);
    unsigned long long n = 0;
    for (size_t i = 0; i < n_streams; i++)
        for (size_t at = streams[i]->head; at < streams[i]->len; at++) n += streams[i]->ops[at].kind == OP_EXTERNAL;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Runs every queued operation of every stream. */
void ppnrt_double_flush(void) {
    pthread_mutex_lock(&lock);
    run_all(NULL);
    pthread_mutex_unlock(&lock);
}

/* Operations queued and not yet run, over all streams. */
unsigned long long ppnrt_double_pending(void) {
    pthread_mutex_lock(&lock);
    unsigned long long n = 0;
    for (size_t i = 0; i < n_streams; i++) n += streams[i]->len - streams[i]->head;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Live (not freed) allocations of one kind: 1 device, 2 pinned. */
unsigned long long ppnrt_double_live_allocations(int kind) {
    pthread_mutex_lock(&lock);
    unsigned long long n = 0;
    for (Alloc* a = allocs; a; a = a->next) n += !a->freed && a->kind == kind;
    pthread_mutex_unlock(&lock);
    return n;
}

/* ------------------------------------------------------------------------------------------ */
/* Initialisation, errors, devices                                                            */

CUresult cuInit(unsigned flags) {
    pthread_mutex_lock(&lock);
    if (!initialized) init_from_env();
    CUresult inj = injected("cuInit");
    if (inj != OK) RETURN(inj);
    if (flags != 0) RETURN(E_INVALID_VALUE);
    initialized = 1;
    RETURN(OK);
}

CUresult cuDriverGetVersion(int* v) {
    pthread_mutex_lock(&lock);
    if (!initialized) init_from_env();
    if (!v) RETURN(E_INVALID_VALUE);
    *v = driver_version;
    RETURN(OK);
}

static const struct {
    int code;
    const char* name;
    const char* text;
} error_table[] = {
    {OK, "CUDA_SUCCESS", "no error"},
    {E_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {E_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {E_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {E_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {E_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {E_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {E_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {E_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {E_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {E_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {E_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {E_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {E_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
    {E_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {E_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {E_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "operation would make the legacy stream depend on a capturing blocking stream"},
    {E_GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {E_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_lookup(CUresult code, const char** out, int text) {
    if (!out) return E_INVALID_VALUE;
    for (size_t i = 0; i < sizeof error_table / sizeof error_table[0]; i++)
        if (error_table[i].code == code) {
            *out = text ? error_table[i].text : error_table[i].name;
            return OK;
        }
    *out = NULL;
    return E_INVALID_VALUE;
}
CUresult cuGetErrorName(CUresult code, const char** out) { return error_lookup(code, out, 0); }
CUresult cuGetErrorString(CUresult code, const char** out) { return error_lookup(code, out, 1); }

CUresult cuDeviceGetCount(int* count) {
    ENTER("cuDeviceGetCount");
    *count = n_devices;
    RETURN(OK);
}

CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
    ENTER("cuDeviceGet");
    if (ordinal < 0 || ordinal >= n_devices) RETURN(E_INVALID_DEVICE);
    *dev = ordinal;
    RETURN(OK);
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    ENTER("cuDeviceGetName");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    snprintf(name, (size_t)len, "ppnrt driver double %d", dev);
    RETURN(OK);
}

CUresult cuDeviceGetPCIBusId(char* id, int len, CUdevice dev) {
    ENTER("cuDeviceGetPCIBusId");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    snprintf(id, (size_t)len, "0000:%02x:00.0", dev + 1);
    RETURN(OK);
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    ENTER("cuDeviceTotalMem_v2");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    *bytes = (size_t)1 << 34;
    RETURN(OK);
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice dev) {
    ENTER("cuDeviceGetAttribute");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    switch (attribute) {
    case 16: *value = 4; break;          /* multiprocessor count */
    case 41: *value = 1; break;          /* unified addressing */
    case 75: *value = 9; break;          /* compute capability major */
    case 76: *value = 0; break;          /* minor */
    case 115: *value = !no_pools; break; /* memory pools supported */
    default: *value = 0; break;
    }
    RETURN(OK);
}

CUresult cuDeviceCanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
    ENTER("cuDeviceCanAccessPeer");
    if (dev < 0 || dev >= n_devices || peer < 0 || peer >= n_devices) RETURN(E_INVALID_DEVICE);
    *can = !no_peer && dev != peer;
    RETURN(OK);
}

CUresult cuDeviceGetP2PAttribute(int* value, int attribute, CUdevice src, CUdevice dst) {
    ENTER("cuDeviceGetP2PAttribute");
    if (src < 0 || src >= n_devices || dst < 0 || dst >= n_devices || src == dst) RETURN(E_INVALID_DEVICE);
    *value = attribute == 1 ? 0 : !no_peer;
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* Contexts                                                                                   */

CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRetain");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    ctxs[dev].refcount++;
    *ctx = &ctxs[dev];
    RETURN(OK);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER("cuDevicePrimaryCtxRelease_v2");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    if (ctxs[dev].refcount == 0) RETURN(E_INVALID_CONTEXT);
    if (--ctxs[dev].refcount == 0) {
        /* The context goes: its work completes, its memory goes with it. */
        run_all(&ctxs[dev]);
        for (Alloc* a = allocs; a; a = a->next)
            if (!a->freed && a->kind == MEM_DEVICE && a->device == dev) free_alloc(a);
        memset(ctxs[dev].peer, 0, sizeof ctxs[dev].peer);
        for (int d = 0; d < n_devices; d++) ctxs[d].peer[dev] = 0;
        ctxs[dev].dead = 0;
    }
    RETURN(OK);
}

CUresult cuCtxSetCurrent(void* ctx) {
    ENTER("cuCtxSetCurrent");
    current = (Ctx*)ctx;
    RETURN(OK);
}

CUresult cuCtxGetCurrent(void** ctx) {
    ENTER("cuCtxGetCurrent");
    *ctx = current;
    RETURN(OK);
}

CUresult cuCtxGetDevice(CUdevice* dev) {
    ENTER("cuCtxGetDevice");
    if (!current) RETURN(E_INVALID_CONTEXT);
    *dev = current->device;
    RETURN(OK);
}

#define NEED_CTX()                                       \
    do {                                                 \
        if (!current || current->refcount == 0) RETURN(E_INVALID_CONTEXT); \
    } while (0)
#define NEED_LIVE_CTX()                 \
    do {                                \
        NEED_CTX();                     \
        if (current->dead) RETURN(current->dead); \
    } while (0)

/* A stream-ordered call on `stream` needs a live current context, and on a created stream its
 * own: the crate binds the stream's context for each such call (driver 580 checks a copy's
 * addresses in the current context, so a peer copy with the other device's context current
 * fails there). */
#define NEED_STREAM_CTX(stream)                                     \
    do {                                                            \
        NEED_LIVE_CTX();                                            \
        Stream* _s = (Stream*)(stream);                             \
        if (_s && _s->ctx != current) RETURN(E_INVALID_CONTEXT);    \
    } while (0)

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize");
    NEED_CTX();
    run_all(current);
    RETURN(current->dead ? current->dead : OK);
}

CUresult cuCtxEnablePeerAccess(void* peer, unsigned flags) {
    ENTER("cuCtxEnablePeerAccess");
    NEED_LIVE_CTX();
    Ctx* p = (Ctx*)peer;
    if (flags != 0 || !p) RETURN(E_INVALID_VALUE);
    if (no_peer || p == current) RETURN(E_PEER_ACCESS_UNSUPPORTED);
    if (current->peer[p->device]) RETURN(E_PEER_ACCESS_ALREADY_ENABLED);
    current->peer[p->device] = 1;
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                     */

CUresult cuDeviceGetDefaultMemPool(void** pool, CUdevice dev) {
    ENTER("cuDeviceGetDefaultMemPool");
    if (dev < 0 || dev >= n_devices) RETURN(E_INVALID_DEVICE);
    if (no_pools) RETURN(E_NOT_SUPPORTED);
    *pool = &ctxs[dev];
    RETURN(OK);
}

CUresult cuMemPoolSetAttribute(void* pool, int attribute, void* value) {
    ENTER("cuMemPoolSetAttribute");
    (void)attribute;
    if (!pool || !value) RETURN(E_INVALID_VALUE);
    RETURN(OK);
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    ENTER("cuMemGetInfo_v2");
    NEED_LIVE_CTX();
    *total = (size_t)1 << 34;
    *free_bytes = *total / 2;
    RETURN(OK);
}

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t bytes) {
    ENTER("cuMemAlloc_v2");
    NEED_LIVE_CTX();
    if (bytes == 0) RETURN(E_INVALID_VALUE);
    Alloc* a = new_alloc(bytes, MEM_DEVICE, current->device, 0);
    if (!a) RETURN(E_OUT_OF_MEMORY);
    *ptr = a->base;
    RETURN(OK);
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    ENTER("cuMemFree_v2");
    NEED_CTX();
    Alloc* a = find_alloc((uintptr_t)ptr, 1, 1);
    if (!a || a->base != ptr || a->kind != MEM_DEVICE || a->pooled) RETURN(E_INVALID_VALUE);
    if (a->freed) {
        violation("cuMemFree: %#llx freed twice", ptr);
        RETURN(E_INVALID_VALUE);
    }
    free_alloc(a);
    RETURN(OK);
}

CUresult cuMemAllocAsync(CUdeviceptr* ptr, size_t bytes, void* stream) {
    ENTER("cuMemAllocAsync");
    NEED_STREAM_CTX(stream);
    if (no_pools) RETURN(E_NOT_SUPPORTED);
    if (bytes == 0) RETURN(E_INVALID_VALUE);
    Stream* s = stream_of(stream);
    if (s->capture) RETURN(refuse_capture(s)); /* graph allocations are not modelled */
    Alloc* a = new_alloc(bytes, MEM_DEVICE, s->ctx->device, 1);
    if (!a) RETURN(E_OUT_OF_MEMORY);
    *ptr = a->base;
    RETURN(OK);
}

CUresult cuMemFreeAsync(CUdeviceptr ptr, void* stream) {
    ENTER("cuMemFreeAsync");
    NEED_STREAM_CTX(stream);
    Alloc* a = find_alloc((uintptr_t)ptr, 1, 0);
    if (!a || a->base != ptr || !a->pooled) RETURN(E_INVALID_VALUE);
    if (stream_of(stream)->capture) RETURN(refuse_capture(stream_of(stream)));
    Op op = {.kind = OP_FREE_ASYNC, .dst = ptr};
    push(stream_of(stream), op);
    RETURN(OK);
}

CUresult cuMemHostAlloc(void** ptr, size_t bytes, unsigned flags) {
    ENTER("cuMemHostAlloc");
    NEED_LIVE_CTX();
    (void)flags;
    if (bytes == 0) RETURN(E_INVALID_VALUE);
    Alloc* a = new_alloc(bytes, MEM_PINNED, -1, 0);
    if (!a) RETURN(E_OUT_OF_MEMORY);
    *ptr = (void*)a->base;
    RETURN(OK);
}

CUresult cuMemFreeHost(void* ptr) {
    ENTER("cuMemFreeHost");
    Alloc* a = find_alloc((uintptr_t)ptr, 1, 1);
    if (!a || a->base != (uintptr_t)ptr || a->kind != MEM_PINNED) RETURN(E_INVALID_VALUE);
    if (a->freed) {
        violation("cuMemFreeHost: %p freed twice", ptr);
        RETURN(E_INVALID_VALUE);
    }
    free_alloc(a);
    RETURN(OK);
}

/* cuPointerGetAttribute for CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2): pageable memory is unknown. */
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
    ENTER("cuPointerGetAttribute");
    Alloc* a = find_alloc((uintptr_t)ptr, 1, 0);
    if (!a) RETURN(E_INVALID_VALUE);
    if (attribute == 2) {
        *(unsigned*)data = a->kind == MEM_PINNED ? 1u : 2u;
        RETURN(OK);
    }
    RETURN(E_INVALID_VALUE);
}

/* cuPointerGetAttributes: unknown addresses succeed with zeroed values. Supports the memory type
 * (2) only. */
CUresult cuPointerGetAttributes(unsigned n, int* attributes, void** data, CUdeviceptr ptr) {
    ENTER("cuPointerGetAttributes");
    Alloc* a = find_alloc((uintptr_t)ptr, 1, 0);
    for (unsigned i = 0; i < n; i++) {
        if (attributes[i] != 2) RETURN(E_INVALID_VALUE);
        *(unsigned*)data[i] = !a ? 0u : a->kind == MEM_PINNED ? 1u : 2u;
    }
    RETURN(OK);
}

static CUresult enqueue_copy(const char* who, CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream,
                             int host_src, int host_dst) {
    Stream* s = stream_of(stream);
    if (!s) return E_INVALID_CONTEXT;
    if (s->ctx->dead) return s->ctx->dead;
    Op op = {.kind = OP_COPY, .dst = dst, .src = src, .bytes = bytes, .src_host = host_src, .dst_host = host_dst};
    if (s->capture && ((host_src && !find_alloc((uintptr_t)src, bytes, 1)) ||
                       (host_dst && !find_alloc((uintptr_t)dst, bytes, 1))))
        return refuse_capture(s); /* pageable memory cannot be captured */
    if (host_src && bytes && !find_alloc((uintptr_t)src, bytes, 1)) {
        /* Pageable source: staged now, the caller may reuse it as soon as this returns. */
        op.staged = malloc(bytes);
        memcpy(op.staged, (const void*)(uintptr_t)src, bytes);
    }
    push(s, op);
    if (host_dst && bytes && !find_alloc((uintptr_t)dst, bytes, 1)) {
        /* Pageable destination: the call returns once the copy is done. */
        run_until_done(s, s->len);
    }
    (void)who;
    return s->ctx->dead ? s->ctx->dead : OK;
}

/* Pool memory of another device than the stream's: its copy engine cannot reach it (the driver
 * refuses a unified-address copy; cuMemcpyPeerAsync stages it). */
static int foreign_pool_memory(void* stream, CUdeviceptr p) {
    Stream* s = stream_of(stream);
    Alloc* a = find_alloc((uintptr_t)p, 1, 0);
    return s && a && a->kind == MEM_DEVICE && a->pooled && a->device != s->ctx->device;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream) {
    ENTER("cuMemcpyAsync");
    NEED_STREAM_CTX(stream);
    if (foreign_pool_memory(stream, dst) || foreign_pool_memory(stream, src)) RETURN(E_INVALID_VALUE);
    RETURN(enqueue_copy("cuMemcpyAsync", dst, src, bytes, stream, 0, 0));
}

CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void* dst_ctx, CUdeviceptr src, void* src_ctx, size_t bytes,
                           void* stream) {
    ENTER("cuMemcpyPeerAsync");
    NEED_STREAM_CTX(stream);
    if (!dst_ctx || !src_ctx) RETURN(E_INVALID_CONTEXT);
    RETURN(enqueue_copy("cuMemcpyPeerAsync", dst, src, bytes, stream, 0, 0));
}

/* Host-device copies take device memory of the stream's own device only, as the driver does. */
static int foreign_device_memory(void* stream, CUdeviceptr p) {
    Stream* s = stream_of(stream);
    Alloc* a = find_alloc((uintptr_t)p, 1, 0);
    return s && a && a->kind == MEM_DEVICE && a->device != s->ctx->device;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
    ENTER("cuMemcpyHtoDAsync_v2");
    NEED_STREAM_CTX(stream);
    if (foreign_device_memory(stream, dst)) RETURN(E_INVALID_VALUE);
    RETURN(enqueue_copy("cuMemcpyHtoDAsync", dst, (CUdeviceptr)(uintptr_t)src, bytes, stream, 1, 0));
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
    ENTER("cuMemcpyDtoHAsync_v2");
    NEED_STREAM_CTX(stream);
    if (foreign_device_memory(stream, src)) RETURN(E_INVALID_VALUE);
    RETURN(enqueue_copy("cuMemcpyDtoHAsync", (CUdeviceptr)(uintptr_t)dst, src, bytes, stream, 0, 1));
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t count, void* stream) {
    ENTER("cuMemsetD8Async");
    NEED_STREAM_CTX(stream);
    Op op = {.kind = OP_SET8, .dst = dst, .bytes = count, .value = value};
    push(stream_of(stream), op);
    RETURN(OK);
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t count, void* stream) {
    ENTER("cuMemsetD32Async");
    NEED_STREAM_CTX(stream);
    if (dst % 4) RETURN(E_INVALID_VALUE);
    Op op = {.kind = OP_SET32, .dst = dst, .bytes = count * 4, .value = value};
    push(stream_of(stream), op);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                         */

CUresult cuStreamCreate(void** stream, unsigned flags) {
    ENTER("cuStreamCreate");
    NEED_LIVE_CTX();
    (void)flags;
    Stream* s = calloc(1, sizeof *s);
    s->ctx = current;
    if (n_streams == cap_streams) {
        cap_streams = cap_streams ? cap_streams * 2 : 16;
        streams = realloc(streams, cap_streams * sizeof *streams);
    }
    streams[n_streams++] = s;
    *stream = s;
    RETURN(OK);
}

CUresult cuStreamDestroy_v2(void* stream) {
    ENTER("cuStreamDestroy_v2");
    Stream* s = (Stream*)stream;
    if (!s || s->destroyed) RETURN(E_INVALID_HANDLE);
    s->destroyed = 1; /* queued work still runs */
    RETURN(OK);
}

CUresult cuStreamSynchronize(void* stream) {
    ENTER("cuStreamSynchronize");
    Stream* s = stream_of(stream);
    if (!s) RETURN(E_INVALID_CONTEXT);
    if (s->capture) RETURN(refuse_capture(s));
    run_until_done(s, s->len);
    RETURN(s->ctx->dead ? s->ctx->dead : OK);
}

CUresult cuStreamQuery(void* stream) {
    ENTER("cuStreamQuery");
    Stream* s = stream_of(stream);
    if (!s) RETURN(E_INVALID_CONTEXT);
    if (s->capture) RETURN(refuse_capture(s));
    if (s->ctx->dead) RETURN(s->ctx->dead);
    if (s->head == s->len) RETURN(OK);
    /* Pending work is not run by one query (that would hide unordered work), but a caller that
     * polls sees the device make progress. */
    if (++s->polls >= 3) {
        s->polls = 0;
        run_until(s, s->len);
    }
    RETURN(E_NOT_READY);
}

CUresult cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
    ENTER("cuStreamWaitEvent");
    NEED_STREAM_CTX(stream);
    Stream* s = stream_of(stream);
    Event* e = (Event*)event;
    if (!e || e->destroyed) RETURN(E_INVALID_HANDLE);
    if (flags & 1) {
        /* CU_EVENT_WAIT_EXTERNAL: a wait node, valid only in a capture, on an event of the
         * stream's device (the driver refuses another device's event there). */
        if (!s->capture || e->ctx != s->ctx) RETURN(E_INVALID_VALUE);
        Op op = {.kind = OP_WAIT, .wait_event = e};
        push(s, op);
        RETURN(OK);
    }
    if (s->capture) {
        /* Joining an event's stream into the capture is not modelled (the crate never does). */
        s->capture_invalid = 1;
        RETURN(E_CAPTURE_ISOLATION);
    }
    if (e->in_capture) {
        violation("cuStreamWaitEvent: the event was last recorded into a capture (the waiting stream would join it)");
        RETURN(E_CAPTURE_ISOLATION);
    }
    if (e->stream) {
        Op op = {.kind = OP_WAIT, .target = e->stream, .target_pos = e->pos};
        push(s, op);
    }
    RETURN(OK);
}

CUresult cuEventCreate(void** event, unsigned flags) {
    ENTER("cuEventCreate");
    NEED_LIVE_CTX();
    Event* e = calloc(1, sizeof *e);
    e->ctx = current;
    e->timing = !(flags & 2);
    *event = e;
    RETURN(OK);
}

CUresult cuEventDestroy_v2(void* event) {
    ENTER("cuEventDestroy_v2");
    Event* e = (Event*)event;
    if (!e || e->destroyed) RETURN(E_INVALID_HANDLE);
    e->destroyed = 1; /* kept: queued records and waits may still refer to it */
    RETURN(OK);
}

CUresult cuEventRecord(void* event, void* stream) {
    ENTER("cuEventRecord");
    NEED_STREAM_CTX(stream);
    Event* e = (Event*)event;
    Stream* s = stream_of(stream);
    if (!e || e->destroyed) RETURN(E_INVALID_HANDLE);
    if (e->ctx != s->ctx) RETURN(E_INVALID_HANDLE);
    if (s->capture) {
        /* Legal: the event now stands for the capture's work so far. Nothing here runs it. */
        e->in_capture = 1;
        e->stream = NULL;
        RETURN(OK);
    }
    e->in_capture = 0;
    e->generation++;
    Op op = {.kind = OP_RECORD, .event = e, .generation = e->generation};
    push(s, op);
    e->stream = s;
    e->pos = s->len;
    e->recorded = 1;
    RETURN(OK);
}

CUresult cuEventQuery(void* event) {
    ENTER("cuEventQuery");
    Event* e = (Event*)event;
    if (!e || e->destroyed) RETURN(E_INVALID_HANDLE);
    if (e->ctx->dead) RETURN(e->ctx->dead);
    if (e->in_capture) {
        violation("cuEventQuery: the event was last recorded into a capture");
        RETURN(E_CAPTURE_ISOLATION);
    }
    if (event_complete(e)) RETURN(OK);
    /* The device progresses under repeated polling: the third query runs the stream up to the
     * event, and it may then be complete. */
    if (++e->polls >= 3) {
        e->polls = 0;
        if (run_until(e->stream, e->pos) && event_complete(e)) RETURN(OK);
    }
    RETURN(E_NOT_READY);
}

CUresult cuEventSynchronize(void* event) {
    ENTER("cuEventSynchronize");
    Event* e = (Event*)event;
    if (!e || e->destroyed) RETURN(E_INVALID_HANDLE);
    if (e->in_capture) {
        violation("cuEventSynchronize: the event was last recorded into a capture");
        RETURN(E_CAPTURE_ISOLATION);
    }
    /* The record as it is now (the event may be recorded again while this waits unlocked). */
    if (e->stream) run_until_done(e->stream, e->pos);
    RETURN(e->ctx->dead ? e->ctx->dead : OK);
}

static CUresult elapsed(float* ms, void* start, void* end) {
    Event *a = (Event*)start, *b = (Event*)end;
    if (!a || !b || a->destroyed || b->destroyed) return E_INVALID_HANDLE;
    if (!a->timing || !b->timing || !a->recorded || !b->recorded) return E_INVALID_HANDLE;
    if (!event_complete(a) || !event_complete(b)) return E_NOT_READY;
    *ms = (float)(b->time_ms - a->time_ms);
    return OK;
}

CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    ENTER("cuEventElapsedTime");
    RETURN(elapsed(ms, start, end));
}

#ifndef PPNRT_DOUBLE_CUDA_12_4
/* Introduced with CUDA 12.8: absent from the 12.4 build of the double, as from a 12.4 driver. */
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    ENTER("cuEventElapsedTime_v2");
    RETURN(elapsed(ms, start, end));
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Modules and launch                                                                         */

typedef struct Module {
    Ctx* ctx;
    int unloaded;
} Module;
typedef struct Function {
    Module* module;
    int kernel;
} Function;

CUresult cuModuleLoadData(void** module, const void* image) {
    ENTER("cuModuleLoadData");
    NEED_LIVE_CTX();
    if (!image || !strstr((const char*)image, ".entry")) RETURN(200 /* CUDA_ERROR_INVALID_IMAGE */);
#ifdef PPNRT_DOUBLE_CUDA_12_4
    /* A 12.4 driver JITs PTX up to ISA 8.4: newer PTX is refused as by the real driver. */
    const char* version = strstr((const char*)image, ".version ");
    if (version && atof(version + 9) > 8.4 + 1e-9) RETURN(222 /* CUDA_ERROR_UNSUPPORTED_PTX_VERSION */);
#endif
    Module* m = calloc(1, sizeof *m);
    m->ctx = current;
    *module = m;
    RETURN(OK);
}

CUresult cuModuleUnload(void* module) {
    ENTER("cuModuleUnload");
    Module* m = (Module*)module;
    if (!m || m->unloaded) RETURN(E_INVALID_HANDLE);
    m->unloaded = 1;
    RETURN(OK);
}

CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
    ENTER("cuModuleGetFunction");
    Module* m = (Module*)module;
    if (!m || m->unloaded) RETURN(E_INVALID_HANDLE);
    for (size_t i = 0; i < N_KERNELS; i++)
        if (strcmp(kernels[i].name, name) == 0) {
            Function* f = calloc(1, sizeof *f);
            f->module = m;
            f->kernel = (int)i;
            *function = f;
            RETURN(OK);
        }
    RETURN(E_NOT_FOUND);
}

CUresult cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
    ENTER("cuLaunchKernel");
    NEED_STREAM_CTX(stream);
    (void)shared;
    Function* f = (Function*)function;
    if (!f || f->module->unloaded || extra) RETURN(E_INVALID_HANDLE);
    if (!gx || !gy || !gz || !bx || !by || !bz || (unsigned long long)bx * by * bz > 1024) RETURN(E_INVALID_VALUE);
    Stream* s = stream_of(stream);
    if (s->ctx != f->module->ctx) RETURN(E_INVALID_HANDLE);
    Op op = {.kind = OP_KERNEL, .kernel = kernels[f->kernel].id};
    for (int i = 0; i < kernels[f->kernel].n_params; i++) {
        if (!params || !params[i]) RETURN(E_INVALID_VALUE);
        /* Parameters are copied at the call, as the driver does. */
        if (kernels[f->kernel].param_size[i] == 8)
            memcpy(&op.params[i], params[i], 8);
        else {
            uint32_t v;
            memcpy(&v, params[i], 4);
            op.params[i] = v;
        }
    }
    push(s, op);
    RETURN(OK);
}

/* ------------------------------------------------------------------------------------------ */
/* Stream capture and graphs                                                                  */

/* A capture's begin or end is not atomic in the real driver against other threads' calls on the
 * stream (driver 580 hung, and under compute-sanitizer crashed, when one thread enqueued on a
 * stream while another began and ended its captures). Called with the lock held: lets other
 * threads in for a moment with the stream marked, so that an enqueue on it meanwhile is seen. */
static void capture_transition(Stream* s) {
    s->in_transition = 1;
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < 20; i++) sched_yield();
    pthread_mutex_lock(&lock);
    s->in_transition = 0;
}

CUresult cuStreamBeginCapture_v2(void* stream, int mode) {
    ENTER("cuStreamBeginCapture_v2");
    NEED_LIVE_CTX();
    Stream* s = (Stream*)stream;
    if (!s || mode < 0 || mode > 2) RETURN(E_INVALID_VALUE);
    if (s->capture) RETURN(E_CAPTURE_UNSUPPORTED);
    capture_transition(s);
    if (s->capture) RETURN(E_CAPTURE_UNSUPPORTED);
    s->capture = calloc(1, sizeof(Graph));
    s->capture->ctx = s->ctx;
    s->capture_invalid = 0;
    RETURN(OK);
}

CUresult cuStreamEndCapture(void* stream, void** graph) {
    ENTER("cuStreamEndCapture");
    Stream* s = (Stream*)stream;
    if (!s || !s->capture) RETURN(E_INVALID_VALUE);
    capture_transition(s);
    if (!s->capture) RETURN(E_INVALID_VALUE);
    Graph* g = s->capture;
    s->capture = NULL;
    if (s->capture_invalid) {
        free(g->ops);
        free(g);
        *graph = NULL;
        RETURN(E_CAPTURE_INVALIDATED);
    }
    *graph = g;
    RETURN(OK);
}

/* 0: not capturing; 1: capturing; 2: capturing, invalidated. */
CUresult cuStreamIsCapturing(void* stream, int* status) {
    ENTER("cuStreamIsCapturing");
    Stream* s = (Stream*)stream;
    if (!s || !status) RETURN(E_INVALID_VALUE);
    *status = !s->capture ? 0 : s->capture_invalid ? 2 : 1;
    RETURN(OK);
}

CUresult cuEventRecordWithFlags(void* event, void* stream, unsigned flags) {
    ENTER("cuEventRecordWithFlags");
    NEED_LIVE_CTX();
    Event* e = (Event*)event;
    Stream* s = stream_of(stream);
    if (!e || e->destroyed || e->ctx != s->ctx) RETURN(E_INVALID_HANDLE);
    if (!(flags & 1) || !s->capture) RETURN(E_INVALID_VALUE); /* external records only, in a capture */
    Op op = {.kind = OP_RECORD, .event = e};
    push(s, op);
    RETURN(OK);
}

static Graph* copy_graph(Graph* g) {
    Graph* c = calloc(1, sizeof *c);
    c->ctx = g->ctx;
    c->len = c->cap = g->len;
    c->ops = malloc((g->len ? g->len : 1) * sizeof(Op));
    memcpy(c->ops, g->ops, g->len * sizeof(Op));
    return c;
}

CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags) {
    ENTER("cuGraphInstantiateWithFlags");
    NEED_LIVE_CTX();
    (void)flags;
    if (!graph) RETURN(E_INVALID_VALUE);
    *exec = copy_graph((Graph*)graph);
    RETURN(OK);
}

CUresult cuGraphUpload(void* exec, void* stream) {
    ENTER("cuGraphUpload");
    NEED_LIVE_CTX();
    Graph* g = (Graph*)exec;
    if (!g || stream_of(stream)->ctx != g->ctx) RETURN(E_INVALID_VALUE);
    RETURN(OK);
}

CUresult cuGraphLaunch(void* exec, void* stream) {
    ENTER("cuGraphLaunch");
    NEED_LIVE_CTX();
    Graph* g = (Graph*)exec;
    Stream* s = stream_of(stream);
    if (!g || s->ctx != g->ctx) RETURN(E_INVALID_VALUE);
    /* The driver refuses a launch into a capture (seen on driver 580: error 900). */
    if (s->capture) RETURN(refuse_capture(s));
    for (size_t i = 0; i < g->len; i++) {
        Op op = g->ops[i];
        if (op.kind == OP_RECORD) {
            /* A record node records the event at this launch. */
            op.event->generation++;
            op.generation = op.event->generation;
            push(s, op);
            if (!s->capture) {
                op.event->in_capture = 0;
                op.event->stream = s;
                op.event->pos = s->len;
                op.event->recorded = 1;
            }
            continue;
        }
        if (op.kind == OP_WAIT && op.wait_event) {
            /* A wait node waits for the event's last record before this launch. */
            Event* e = op.wait_event;
            if (s->capture) {
                push(s, op);
            } else if (e->stream) {
                Op wait = {.kind = OP_WAIT, .target = e->stream, .target_pos = e->pos};
                push(s, wait);
            }
            continue;
        }
        push(s, op);
    }
    RETURN(OK);
}

CUresult cuGraphExecUpdate_v2(void* exec, void* graph, void* result_info) {
    ENTER("cuGraphExecUpdate_v2");
    NEED_LIVE_CTX();
    Graph* e = (Graph*)exec;
    Graph* g = (Graph*)graph;
    /* CUgraphExecUpdateResultInfo: { result, errorNode, errorFromNode } */
    struct { int result; void* error_node; void* error_from_node; } *info = result_info;
    if (!e || !g || !info) RETURN(E_INVALID_VALUE);
    int topology = e->len != g->len;
    for (size_t i = 0; !topology && i < g->len; i++)
        topology = e->ops[i].kind != g->ops[i].kind ||
                   (g->ops[i].kind == OP_KERNEL && e->ops[i].kernel != g->ops[i].kernel);
    if (topology) {
        info->result = 2; /* CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED */
        RETURN(E_GRAPH_EXEC_UPDATE_FAILURE);
    }
    memcpy(e->ops, g->ops, g->len * sizeof(Op));
    info->result = 0;
    RETURN(OK);
}

CUresult cuGraphGetNodes(void* graph, void** nodes, size_t* count) {
    ENTER("cuGraphGetNodes");
    Graph* g = (Graph*)graph;
    if (!g || !count || nodes) RETURN(E_INVALID_VALUE); /* the count query only */
    *count = g->len;
    RETURN(OK);
}

CUresult cuGraphDestroy(void* graph) {
    ENTER("cuGraphDestroy");
    Graph* g = (Graph*)graph;
    if (!g) RETURN(E_INVALID_VALUE);
    free(g->ops);
    free(g);
    RETURN(OK);
}

CUresult cuGraphExecDestroy(void* exec) {
    ENTER("cuGraphExecDestroy");
    Graph* g = (Graph*)exec;
    if (!g) RETURN(E_INVALID_VALUE);
    /* Runs already queued hold copies of the ops. */
    free(g->ops);
    free(g);
    RETURN(OK);
}
