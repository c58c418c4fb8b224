/* A stand-in libnvidia-ml.so.1 for tests: the C symbols agent/nvml.py calls, with NVML's
 * signatures and return codes, over a scripted box read from the file named by
 * FAKE_NVML_CONTROL at every call (so a test changes the box while the host runs):
 *
 *   gpus=2  driver=580.159.04  cuda=13000  util=97  power=650000  limit=700000  temp=61
 *   mem_total=150754820096  mem_used=30000000000 (bytes; free is what is left)
 *   mem_rc=4 (nvmlDeviceGetMemoryInfo answers that code, e.g. NO_PERMISSION)
 *   ecc=0  reasons=0  init_rc=0  lost=1 (GPU 1 is lost: its calls answer 15)
 *   xids=0:79,1:13 (Xid events in order; each is delivered once)
 *   hang=<symbol> (that call never returns)  crash=<symbol> (that call segfaults)
 *   no_events=1 (registering events answers NOT_SUPPORTED)  calls=<path> (each call appends
 *   its name to that file)
 *   cuda=... is the CUDA version; libcuda=1: nvmlInitWithFlags dlopens "libcuda.so.1" as the
 *   real library does (580 drivers), and records "libcuda:loaded" or "libcuda:refused" in the
 *   calls file; libcuda=2: the same, and the init fails (ERROR_UNKNOWN) without it
 *
 * Build: cc -shared -fPIC -o DIR/libnvidia-ml.so.1 fake_nvml.c (tests/test_nvmlhost.py).
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct { int index; } dev_t_;
typedef struct { dev_t_ *device; unsigned long long eventType, eventData; unsigned int gi, ci; } event_t;
typedef struct { unsigned int gpu, memory; } util_t;
typedef struct { unsigned long long total, free, used; } memory_t;  /* nvmlMemory_t (v1) */

static dev_t_ devs[16];
static int events_set;
static int delivered;
static int initialised;

static int ctl(const char *key, char *out, size_t n) {
    const char *path = getenv("FAKE_NVML_CONTROL");
    if (!path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[1024];
    size_t k = strlen(key);
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, k) == 0 && line[k] == '=') {
            line[strcspn(line, "\r\n")] = 0;
            snprintf(out, n, "%s", line + k + 1);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static long num(const char *key, long dflt) {
    char v[64];
    return ctl(key, v, sizeof v) ? strtol(v, NULL, 0) : dflt;
}

static void enter(const char *fn) {
    char v[256];
    if (ctl("calls", v, sizeof v)) {
        FILE *f = fopen(v, "a");
        if (f) { fprintf(f, "%s\n", fn); fclose(f); }
    }
    if (ctl("hang", v, sizeof v) && strcmp(v, fn) == 0) for (;;) pause();
    if (ctl("crash", v, sizeof v) && strcmp(v, fn) == 0) raise(SIGSEGV);
}

static int gpus(void) { return (int)num("gpus", 1); }

static int check(dev_t_ *d) {
    if (!initialised) return 1;                       /* UNINITIALIZED */
    if (d < devs || d >= devs + gpus()) return 2;     /* INVALID_ARGUMENT */
    if (num("lost", -1) == d->index) return 15;       /* GPU_IS_LOST */
    return 0;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags; enter("nvmlInitWithFlags");
    long wants_cuda = num("libcuda", 0);
    if (wants_cuda) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        enter(cuda ? "libcuda:loaded" : "libcuda:refused");
        if (!cuda && wants_cuda == 2) return 999;
    }
    int rc = (int)num("init_rc", 0);
    if (rc == 0) initialised = 1;
    return rc;
}
int nvmlShutdown(void) { enter("nvmlShutdown"); initialised = 0; return 0; }
const char *nvmlErrorString(int rc) { (void)rc; return "a fake NVML error"; }

int nvmlDeviceGetCount_v2(unsigned int *n) {
    enter("nvmlDeviceGetCount_v2");
    if (!initialised) return 1;
    *n = (unsigned int)gpus();
    return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, dev_t_ **out) {
    enter("nvmlDeviceGetHandleByIndex_v2");
    if (!initialised) return 1;
    if ((int)i >= gpus()) return 2;
    devs[i].index = (int)i;
    if (num("lost", -1) == (long)i) return 15;
    *out = &devs[i];
    return 0;
}
int nvmlDeviceGetUUID(dev_t_ *d, char *buf, unsigned int n) {
    enter("nvmlDeviceGetUUID");
    int rc = check(d); if (rc) return rc;
    snprintf(buf, n, "GPU-fake-%d", d->index);
    return 0;
}
int nvmlDeviceGetIndex(dev_t_ *d, unsigned int *i) {
    enter("nvmlDeviceGetIndex");
    int rc = check(d); if (rc) return rc;
    *i = (unsigned int)d->index;
    return 0;
}
int nvmlDeviceGetUtilizationRates(dev_t_ *d, util_t *u) {
    enter("nvmlDeviceGetUtilizationRates");
    int rc = check(d); if (rc) return rc;
    u->gpu = (unsigned int)num("util", 0); u->memory = (unsigned int)num("memutil", 0);
    return 0;
}
int nvmlDeviceGetMemoryInfo(dev_t_ *d, memory_t *m) {
    enter("nvmlDeviceGetMemoryInfo");
    int rc = check(d); if (rc) return rc;
    if (!m) return 2;                                 /* INVALID_ARGUMENT */
    rc = (int)num("mem_rc", 0); if (rc) return rc;
    char v[64];
    /* strtoull: 141 GiB does not fit the long of num() on every platform. */
    unsigned long long total = ctl("mem_total", v, sizeof v) ? strtoull(v, NULL, 0) : 85899345920ULL;
    unsigned long long used = ctl("mem_used", v, sizeof v) ? strtoull(v, NULL, 0) : 0ULL;
    if (used > total) used = total;
    m->total = total; m->used = used; m->free = total - used;
    return 0;
}
#define UINT_GETTER(name, key, dflt) \
    int name(dev_t_ *d, unsigned int *v) { \
        enter(#name); int rc = check(d); if (rc) return rc; \
        *v = (unsigned int)num(key, dflt); return 0; }
UINT_GETTER(nvmlDeviceGetPowerUsage, "power", 80000)
UINT_GETTER(nvmlDeviceGetEnforcedPowerLimit, "limit", 700000)

int nvmlDeviceGetTemperature(dev_t_ *d, int sensor, unsigned int *t) {
    enter("nvmlDeviceGetTemperature");
    int rc = check(d); if (rc) return rc;
    if (sensor != 0) return 2;
    *t = (unsigned int)num("temp", 40);
    return 0;
}
int nvmlDeviceGetTotalEccErrors(dev_t_ *d, int etype, int ctype, unsigned long long *c) {
    enter("nvmlDeviceGetTotalEccErrors");
    int rc = check(d); if (rc) return rc;
    if (etype != 1 || ctype != 0) return 2;  /* the agent asks: uncorrected, volatile */
    long ecc = num("ecc", -1);
    if (ecc < 0) return 3;                    /* NOT_SUPPORTED: ECC off */
    *c = (unsigned long long)ecc;
    return 0;
}
int nvmlDeviceGetCurrentClocksEventReasons(dev_t_ *d, unsigned long long *r) {
    enter("nvmlDeviceGetCurrentClocksEventReasons");
    int rc = check(d); if (rc) return rc;
    *r = (unsigned long long)num("reasons", 0);
    return 0;
}
int nvmlEventSetCreate(int **set) {
    enter("nvmlEventSetCreate");
    if (!initialised) return 1;
    *set = &events_set;
    return 0;
}
int nvmlDeviceRegisterEvents(dev_t_ *d, unsigned long long types, int *set) {
    enter("nvmlDeviceRegisterEvents");
    int rc = check(d); if (rc) return rc;
    if (set != &events_set || types != 8) return 2;
    if (num("no_events", 0)) return 3;
    return 0;
}
int nvmlEventSetWait_v2(int *set, event_t *data, unsigned int timeout_ms) {
    enter("nvmlEventSetWait_v2");
    if (!initialised) return 1;
    if (set != &events_set) return 2;
    char v[512];
    if (ctl("xids", v, sizeof v)) {
        int seen = 0;
        for (char *tok = strtok(v, ","); tok; tok = strtok(NULL, ","), seen++) {
            if (seen < delivered) continue;
            int gpu = 0, xid = 0;
            if (sscanf(tok, "%d:%d", &gpu, &xid) != 2 || gpu < 0 || gpu >= 16) return 2;
            delivered++;
            memset(data, 0, sizeof *data);
            devs[gpu].index = gpu;
            data->device = &devs[gpu];
            data->eventType = 8;
            data->eventData = (unsigned long long)xid;
            return 0;
        }
    }
    if (timeout_ms) usleep(timeout_ms * 1000);
    return 10; /* TIMEOUT: no event */
}
int nvmlEventSetFree(int *set) { enter("nvmlEventSetFree"); return set == &events_set ? 0 : 2; }
int nvmlSystemGetDriverVersion(char *buf, unsigned int n) {
    enter("nvmlSystemGetDriverVersion");
    if (!initialised) return 1;
    char v[80];
    if (!ctl("driver", v, sizeof v)) snprintf(v, sizeof v, "580.159.04");
    snprintf(buf, n, "%s", v);
    return 0;
}
int nvmlSystemGetCudaDriverVersion(int *v) {
    enter("nvmlSystemGetCudaDriverVersion");
    if (!initialised) return 1;
    *v = (int)num("cuda", 13000);
    return 0;
}
