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
 * - The helper kernels of kernels/ run as C twins (bit for bit: fmaf is exactly rounded). The
 *   gated signal (ppnrt_gated_signal), which writes a word another process reads, is run without
 *   being asked, as a stream memory operation is (cuda_double_ipc.inc).
 * - Fault injection: ppnrt_double_fail(entry, nth, code) makes the nth next call of `entry`
 *   return `code`; PPNRT_DOUBLE_FAIL="entry:nth[:code],..." does the same from the start.
 * - PPNRT_DOUBLE_NO_POOLS=1: devices without memory pools (cuMemAllocAsync is not supported).
 *   PPNRT_DOUBLE_NO_PEER=1: no peer access. PPNRT_DOUBLE_VERSION: the reported driver version.
 *   ppnrt_double_no_peer(on) turns peer access off (on = 1) or back on while the double runs.
 *   PPNRT_DOUBLE_NO_IPC=1: no virtual memory management, descriptor export or IPC events.
 *   Built with -DPPNRT_DOUBLE_CUDA_12_4 it reports 12.4 and lacks the entry points that came
 *   later (cuEventElapsedTime_v2), as an older driver does.
 * - Memory and events shared between processes (cuMemCreate and POSIX descriptors, legacy
 *   handles, interprocess events) are memfd mappings: cuda_double_ipc.inc says how.
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
#include <sys/mman.h>
#include <unistd.h>

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
    /* A mapping of a memfd another process may map too (cuda_double_ipc.inc): a free replaces
     * it with private memory (the other process's bytes stay), a release unmaps it. */
    int shared;
    int ipc_fd;      /* the memfd of an allocation whose legacy handle was taken, or -1 */
    int legacy_refs; /* opens of a legacy handle in this process (an import) */
    int registered;  /* the caller's pages, registered (cuMemHostRegister): never poisoned or freed */
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
    struct IpcEvent* ipc; /* an interprocess event's shared state (cuda_double_ipc.inc) */
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
static int no_ipc;
static void ipc_detach(struct Alloc* a);
static int ipc_export_freed(struct Alloc* a);

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
    no_ipc = getenv("PPNRT_DOUBLE_NO_IPC") && strcmp(getenv("PPNRT_DOUBLE_NO_IPC"), "1") == 0;
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

/* The allocations of `allocs` (live and quarantined) sorted by base address, so that finding
 * the one an address lies in is a binary search: the fault sweeps look up every operation's
 * addresses among thousands of quarantined allocations. No two of them overlap (a quarantined
 * allocation's memory is not released, so it cannot be handed out again). */
static Alloc** by_base;
static size_t n_by_base, cap_by_base;

/* The index in by_base of the first allocation whose base lies above p. */
static size_t first_above(uintptr_t p) {
    size_t lo = 0, hi = n_by_base;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (by_base[mid]->base <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static Alloc* find_alloc(uintptr_t p, size_t bytes, int include_freed) {
    (void)bytes;
    size_t at = first_above(p);
    if (at == 0) return NULL;
    Alloc* a = by_base[at - 1];
    if (p >= a->base + (a->size ? a->size : 1)) return NULL;
    if (!include_freed && a->freed) return NULL;
    return a;
}

/* Whether by_base has room for one more allocation (grown when full). */
static int by_base_has_room(void) {
    if (n_by_base < cap_by_base) return 1;
    size_t cap = cap_by_base ? 2 * cap_by_base : 1024;
    Alloc** grown = realloc(by_base, cap * sizeof *grown);
    if (!grown) return 0;
    by_base = grown;
    cap_by_base = cap;
    return 1;
}

/* Enters `a` (its base set) in the list and the index find_alloc searches; 0 when out of room. */
static int index_alloc(Alloc* a) {
    if (!by_base_has_room()) return 0;
    size_t at = first_above(a->base);
    memmove(&by_base[at + 1], &by_base[at], (n_by_base - at) * sizeof *by_base);
    by_base[at] = a;
    n_by_base++;
    a->next = allocs;
    allocs = a;
    return 1;
}

static Alloc* new_alloc(size_t bytes, int kind, int device, int pooled) {
    size_t size = bytes ? bytes : 1;
    /* Page-aligned: a legacy handle's export maps a memfd over the allocation's pages. */
    void* mem = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);
    if (!mem) return NULL;
    memset(mem, 0xA5, size); /* fresh device memory holds garbage, not zeros */
    Alloc* a = calloc(1, sizeof *a);
    if (!a || !by_base_has_room()) {
        free(a);
        free(mem);
        return NULL;
    }
    a->base = (uintptr_t)mem;
    a->size = size;
    a->kind = kind;
    a->device = device;
    a->pooled = pooled;
    a->ipc_fd = -1;
    index_alloc(a); /* room checked above */
    return a;
}

/* Poisons and quarantines an allocation; releases the oldest quarantined ones past a budget. */
static void free_alloc(Alloc* a) {
    a->freed = 1;
    if (a->shared || a->ipc_fd >= 0) ipc_detach(a);
    memset((void*)a->base, 0xDB, a->size);
    quarantined += a->size;
    while (quarantined > QUARANTINE_BYTES) {
        Alloc **oldest = NULL, **pp = &allocs;
        for (; *pp; pp = &(*pp)->next)
            if ((*pp)->freed) oldest = pp;
        if (!oldest) break;
        Alloc* victim = *oldest;
        *oldest = victim->next;
        size_t at = first_above(victim->base) - 1;
        memmove(&by_base[at], &by_base[at + 1], (n_by_base - at - 1) * sizeof *by_base);
        n_by_base--;
        quarantined -= victim->size;
        if (victim->shared)
            munmap((void*)victim->base, (victim->size + 4095) & ~(size_t)4095);
        else
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
    if (a->legacy_refs && ipc_export_freed(a)) {
        violation("%s: address %#llx is a legacy import whose exporter freed it (undefined behaviour)", who, p);
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

enum { K_FILL_PATTERN = 1, K_FILL_U32, K_CHECKSUM, K_SPIN, K_COPY_BYTES, K_TRAP, K_TOY_LAYER, K_GATED_COPY, K_GATED_SIGNAL };
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
    {"ppnrt_gated_copy_bytes", K_GATED_COPY, 5, {8, 8, 8, 8, 8}},
    {"ppnrt_gated_signal", K_GATED_SIGNAL, 4, {8, 8, 8, 8}},
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
    case K_GATED_COPY: {
        /* ppnrt_gated_copy_bytes(dst, src, bytes, gate, released): the copy, unless the gate (a
         * word the launching device reads, 8-byte aligned) is at `released` or above when it runs,
         * then nothing is written. Every range is checked either way, as the arguments must be. */
        size_t bytes = (size_t)p[2];
        if (p[3] % 8) {
            violation("ppnrt_gated_copy_bytes (gate): %#llx is not 8-byte aligned", p[3]);
            goto illegal;
        }
        if (!kernel_range(ctx, "ppnrt_gated_copy_bytes (gate)", p[3], 8) ||
            !kernel_range(ctx, "ppnrt_gated_copy_bytes (dst)", p[0], bytes) ||
            !kernel_range(ctx, "ppnrt_gated_copy_bytes (src)", p[1], bytes))
            goto illegal;
        if (__atomic_load_n((unsigned long long*)(uintptr_t)p[3], __ATOMIC_ACQUIRE) >= p[4]) break;
        memmove((void*)(uintptr_t)p[0], (const void*)(uintptr_t)p[1], bytes);
        break;
    }
    case K_GATED_SIGNAL: {
        /* ppnrt_gated_signal(signal, value, gate, released): `value` into the signal word, or
         * `released` when the gate is at `released` or above (both words 8-byte aligned). */
        if (p[0] % 8 || p[2] % 8) {
            violation("ppnrt_gated_signal: a word that is not 8-byte aligned (%#llx, %#llx)", p[0], p[2]);
            goto illegal;
        }
        if (!kernel_range(ctx, "ppnrt_gated_signal (gate)", p[2], 8) ||
            !kernel_range(ctx, "ppnrt_gated_signal (signal)", p[0], 8))
            goto illegal;
        unsigned long long gate = __atomic_load_n((unsigned long long*)(uintptr_t)p[2], __ATOMIC_ACQUIRE);
        __atomic_store_n((unsigned long long*)(uintptr_t)p[0], gate < p[3] ? p[1] : p[3], __ATOMIC_RELEASE);
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

/* The entry points, by resource. */
#include "cuda_double_devices_memory.inc"
#include "cuda_double_ipc.inc"
#include "cuda_double_streams_graphs.inc"
