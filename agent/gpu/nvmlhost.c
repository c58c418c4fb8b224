/* The NVML host in C: the same protocol as ``python -I -S agent/gpu/nvml.py`` (its text says
 * it), for boxes with a C compiler. agent/gpu/nvmlhost.py builds it once (``cc -O2``) into the
 * agent's cache folder and starts it instead of the Python host; where no compiler is found, or
 * the build fails, the Python host runs as before.
 *
 * Why (issue 26, measured on an H200 with driver 580.159.04): the Python host is 25.0 MiB PSS,
 * 18 of it NVML's own initialisation; the interpreter around it is the rest. This program is
 * 0.4 MiB before ``nvmlInitWithFlags`` and 19.9 MiB after it and every call the agent makes.
 *
 * libcuda: that driver's ``nvmlInitWithFlags`` dlopens ``libcuda.so.1`` (and
 * ``nvmlSystemGetCudaDriverVersion`` again), 3.9 MiB of the host. Every call the agent makes
 * answers the same without it (measured there: count, handle, power, temperature, utilisation,
 * ECC, clock reasons, the Xid event set and its wait, the driver's and CUDA's versions), so this
 * program answers ``dlopen`` of a ``libcuda`` itself, with NULL: 16.0 MiB after the same calls.
 * Where an init fails that way, it lets libcuda load and initialises again (a driver that needs
 * it works as before, and the agent is told nothing different).
 *
 * Protocol: one JSON request per line on stdin, ``{"fn": "nvmlDeviceGetPowerUsage", "args":
 * [handle]}``; one JSON answer per line on stdout, ``{"ok": 79069}`` or ``{"err": 15, "msg": "GPU
 * is lost"}``. Arguments are integers; handles and event sets travel as integers (their
 * addresses here), structures as objects, with the field names of pynvml's. A request it cannot
 * read, or a call it does not know, is answered with NVML_ERROR_INVALID_ARGUMENT (2) and it
 * keeps serving. ``libnvidia-ml.so.1`` is loaded by the first ``nvmlInit``. SIGINT is ignored (a
 * Ctrl-C meant for the agent); the host ends at the end of its input.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINE 65536
#define MAX_ARGS 8

/* nvml.h's return codes that pynvml names (agent/gpu/nvml.py's _WORDS, word for word). */
static const char *words(int code) {
    switch (code) {
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 6: return "Not Found";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 999: return "Unknown Error";
    default: return NULL;
    }
}

typedef struct { unsigned int gpu, memory; } util_t;
typedef struct { unsigned long long total, free, used; } memory_t; /* nvmlMemory_t (v1) */
typedef struct {
    void *device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} event_t;

static void *lib;
static int refuse_libcuda = 1;

/* The dynamic loader's dlopen, as NVML calls it (this program's own symbol, exported with
 * -rdynamic, comes first): a libcuda is refused while refuse_libcuda is set. */
void *dlopen(const char *file, int mode) {
    static void *(*real)(const char *, int);
    if (!real) real = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
    if (refuse_libcuda && file && strstr(file, "libcuda")) return NULL;
    return real ? real(file, mode) : NULL;
}

/* ---- output ------------------------------------------------------------------------------- */

static void put_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f) printf("\\u%04x", *p);
        else if (*p >= 0x80) fputs("\\ufffd", stdout); /* as Python's decode("utf-8", "replace") */
        else putchar(*p);
    }
    putchar('"');
}

static void answer_err(int code, const char *msg) {
    printf("{\"err\": %d, \"msg\": ", code);
    put_string(msg);
    fputs("}\n", stdout);
}

static void nvml_err(int code) {
    const char *msg = words(code);
    char fallback[48];
    if (!msg && lib) {
        const char *(*text)(int) = (const char *(*)(int))dlsym(lib, "nvmlErrorString");
        if (text) msg = text(code);
    }
    if (!msg || !*msg) {
        snprintf(fallback, sizeof fallback, "NVML error %d", code);
        msg = fallback;
    }
    answer_err(code, msg);
}

/* ---- input: {"fn": "<name>", "args": [<integer>, ...]} and nothing it does not need --------- */

typedef struct { const char *p; } cursor;

static void ws(cursor *c) { while (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n') c->p++; }

/* A JSON string into out (escapes kept as they are: a call's name has none); 0 if malformed. */
static int read_string(cursor *c, char *out, size_t n) {
    size_t k = 0;
    if (*c->p != '"') return 0;
    c->p++;
    while (*c->p && *c->p != '"') {
        if (*c->p == '\\') { /* an escape: kept as it is, and the character after it */
            if (!c->p[1]) return 0;
            if (k + 1 < n) out[k++] = *c->p;
            c->p++;
        }
        if (k + 1 < n) out[k++] = *c->p;
        c->p++;
    }
    if (*c->p != '"') return 0;
    c->p++;
    out[k] = 0;
    return 1;
}

static int skip_value(cursor *c, int depth);

static int skip_container(cursor *c, char close, int depth) {
    c->p++;
    ws(c);
    if (*c->p == close) { c->p++; return 1; }
    for (;;) {
        ws(c);
        if (close == '}') {
            char key[8];
            if (!read_string(c, key, sizeof key)) return 0;
            ws(c);
            if (*c->p != ':') return 0;
            c->p++;
        }
        if (!skip_value(c, depth + 1)) return 0;
        ws(c);
        if (*c->p == ',') { c->p++; continue; }
        if (*c->p == close) { c->p++; return 1; }
        return 0;
    }
}

static int skip_value(cursor *c, int depth) {
    char tmp[8];
    ws(c);
    if (depth > 32) return 0;
    if (*c->p == '"') return read_string(c, tmp, sizeof tmp);
    if (*c->p == '{') return skip_container(c, '}', depth);
    if (*c->p == '[') return skip_container(c, ']', depth);
    if (!strncmp(c->p, "true", 4)) { c->p += 4; return 1; }
    if (!strncmp(c->p, "false", 5)) { c->p += 5; return 1; }
    if (!strncmp(c->p, "null", 4)) { c->p += 4; return 1; }
    const char *start = c->p;
    if (*c->p == '-') c->p++;
    while (isdigit((unsigned char)*c->p) || *c->p == '.' || *c->p == 'e' || *c->p == 'E' ||
           *c->p == '+' || *c->p == '-')
        c->p++;
    return c->p > start;
}

/* An integer argument (a JSON integer, in 64 bits: handles are addresses). */
static int read_int(cursor *c, unsigned long long *out) {
    int neg = 0;
    if (*c->p == '-') { neg = 1; c->p++; }
    if (!isdigit((unsigned char)*c->p)) return 0;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(c->p, &end, 10);
    if (errno || *end == '.' || *end == 'e' || *end == 'E') return 0;
    c->p = end;
    *out = neg ? (unsigned long long)(-(long long)v) : v;
    return 1;
}

/* 1: parsed; 0: not a request (msg says why). */
static int parse(const char *line, char *fn, size_t fn_n, unsigned long long *args, int *nargs,
                 const char **msg) {
    cursor c = {line};
    int have_fn = 0;
    *nargs = 0;
    ws(&c);
    if (*c.p != '{') { *msg = "not a JSON object"; return 0; }
    c.p++;
    ws(&c);
    if (*c.p == '}') { *msg = "no \"fn\""; return 0; }
    for (;;) {
        char key[16];
        ws(&c);
        if (!read_string(&c, key, sizeof key)) { *msg = "malformed JSON"; return 0; }
        ws(&c);
        if (*c.p != ':') { *msg = "malformed JSON"; return 0; }
        c.p++;
        ws(&c);
        if (!strcmp(key, "fn")) {
            if (!read_string(&c, fn, fn_n)) { *msg = "\"fn\" is not a string"; return 0; }
            have_fn = 1;
        } else if (!strcmp(key, "args")) {
            if (*c.p != '[') { *msg = "\"args\" is not a list"; return 0; }
            c.p++;
            ws(&c);
            if (*c.p == ']') c.p++;
            else for (;;) {
                ws(&c);
                if (*nargs >= MAX_ARGS) { *msg = "too many arguments"; return 0; }
                if (!read_int(&c, &args[*nargs])) { *msg = "an argument is not an integer"; return 0; }
                (*nargs)++;
                ws(&c);
                if (*c.p == ',') { c.p++; continue; }
                if (*c.p == ']') { c.p++; break; }
                *msg = "malformed JSON";
                return 0;
            }
        } else if (!skip_value(&c, 0)) {
            *msg = "malformed JSON";
            return 0;
        }
        ws(&c);
        if (*c.p == ',') { c.p++; continue; }
        if (*c.p == '}') { c.p++; break; }
        *msg = "malformed JSON";
        return 0;
    }
    ws(&c);
    if (*c.p) { *msg = "malformed JSON"; return 0; }
    if (!have_fn) { *msg = "no \"fn\""; return 0; }
    return 1;
}

/* ---- the calls ---------------------------------------------------------------------------- */

#define HANDLE(i) ((void *)(unsigned long)(args[i]))

static void *sym(const char *name, int *err) {
    if (!lib) { *err = 1; return NULL; } /* NVML_ERROR_UNINITIALIZED, as the Python host */
    void *f = dlsym(lib, name);
    if (!f) *err = 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    return f;
}

typedef int (*f_v)(void);
typedef int (*f_u)(unsigned int);
typedef int (*f_pu)(unsigned int *);
typedef int (*f_i)(int *);
typedef int (*f_upp)(unsigned int, void **);
typedef int (*f_hpu)(void *, unsigned int *);
typedef int (*f_hull)(void *, unsigned long long *);
typedef int (*f_hip)(void *, int, unsigned int *);
typedef int (*f_hiipull)(void *, int, int, unsigned long long *);
typedef int (*f_hbuf)(void *, char *, unsigned int);
typedef int (*f_buf)(char *, unsigned int);
typedef int (*f_hutil)(void *, util_t *);
typedef int (*f_hmem)(void *, memory_t *);
typedef int (*f_pp)(void **);
typedef int (*f_hullp)(void *, unsigned long long, void *);
typedef int (*f_pevu)(void *, event_t *, unsigned int);
typedef int (*f_p)(void *);

struct call { const char *name; int nargs; };
static const struct call CALLS[] = {
    {"nvmlInit", 0}, {"nvmlShutdown", 0}, {"nvmlDeviceGetCount", 0},
    {"nvmlDeviceGetHandleByIndex", 1}, {"nvmlDeviceGetUUID", 1}, {"nvmlDeviceGetIndex", 1},
    {"nvmlDeviceGetUtilizationRates", 1}, {"nvmlDeviceGetMemoryInfo", 1},
    {"nvmlDeviceGetPowerUsage", 1}, {"nvmlDeviceGetEnforcedPowerLimit", 1},
    {"nvmlDeviceGetTemperature", 2}, {"nvmlDeviceGetTotalEccErrors", 3},
    {"nvmlDeviceGetCurrentClocksEventReasons", 1}, {"nvmlDeviceGetCurrentClocksThrottleReasons", 1},
    {"nvmlEventSetCreate", 0}, {"nvmlDeviceRegisterEvents", 3}, {"nvmlEventSetWait", 2},
    {"nvmlEventSetFree", 1}, {"nvmlSystemGetDriverVersion", 0}, {"nvmlSystemGetCudaDriverVersion", 0},
};

static void call(const char *fn, const unsigned long long *args, int nargs) {
    const struct call *known = NULL;
    for (size_t i = 0; i < sizeof CALLS / sizeof CALLS[0]; i++)
        if (!strcmp(CALLS[i].name, fn)) known = &CALLS[i];
    if (!known) {
        char msg[160];
        snprintf(msg, sizeof msg, "no such call: '%.120s'", fn);
        answer_err(2, msg);
        return;
    }
    if (nargs != known->nargs) {
        char msg[200];
        snprintf(msg, sizeof msg, "bad request: %s takes %d arguments, %d given", fn, known->nargs, nargs);
        answer_err(2, msg);
        return;
    }
    int err = 0, rc;
    void *f;
    if (!strcmp(fn, "nvmlInit")) {
        if (!lib) lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!lib) { nvml_err(12); return; }
        if (!(f = sym("nvmlInitWithFlags", &err))) { nvml_err(err); return; }
        rc = ((f_u)f)(0);
        if (rc && refuse_libcuda) { /* a driver that needs libcuda to start: let it load */
            refuse_libcuda = 0;
            rc = ((f_u)f)(0);
        }
        if (rc) nvml_err(rc); else fputs("{\"ok\": null}\n", stdout);
        return;
    }
    if (!strcmp(fn, "nvmlShutdown")) {
        if (!(f = sym("nvmlShutdown", &err))) { nvml_err(err); return; }
        rc = ((f_v)f)();
        if (rc) nvml_err(rc); else fputs("{\"ok\": null}\n", stdout);
        return;
    }
    /* Calls that answer one unsigned int (or long long) through a pointer after a handle. */
    static const char *const UINT_AFTER_HANDLE[] = {
        "nvmlDeviceGetIndex", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
    };
    for (size_t i = 0; i < sizeof UINT_AFTER_HANDLE / sizeof UINT_AFTER_HANDLE[0]; i++) {
        if (strcmp(fn, UINT_AFTER_HANDLE[i])) continue;
        unsigned int out = 0;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hpu)f)(HANDLE(0), &out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %u}\n", out);
        return;
    }
    static const char *const ULL_AFTER_HANDLE[] = {
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    };
    for (size_t i = 0; i < sizeof ULL_AFTER_HANDLE / sizeof ULL_AFTER_HANDLE[0]; i++) {
        if (strcmp(fn, ULL_AFTER_HANDLE[i])) continue;
        unsigned long long out = 0;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hull)f)(HANDLE(0), &out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %llu}\n", out);
        return;
    }
    if (!strcmp(fn, "nvmlDeviceGetCount")) {
        unsigned int out = 0;
        if (!(f = sym("nvmlDeviceGetCount_v2", &err))) { nvml_err(err); return; }
        rc = ((f_pu)f)(&out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %u}\n", out);
    } else if (!strcmp(fn, "nvmlDeviceGetHandleByIndex")) {
        void *out = NULL;
        if (!(f = sym("nvmlDeviceGetHandleByIndex_v2", &err))) { nvml_err(err); return; }
        rc = ((f_upp)f)((unsigned int)args[0], &out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %llu}\n", (unsigned long long)(unsigned long)out);
    } else if (!strcmp(fn, "nvmlDeviceGetUUID") || !strcmp(fn, "nvmlSystemGetDriverVersion")) {
        char buf[96] = {0}; /* NVML_DEVICE_UUID_V2_BUFFER_SIZE; the driver's version takes 80 */
        int uuid = !strcmp(fn, "nvmlDeviceGetUUID");
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = uuid ? ((f_hbuf)f)(HANDLE(0), buf, 96) : ((f_buf)f)(buf, 80);
        buf[sizeof buf - 1] = 0;
        if (rc) { nvml_err(rc); return; }
        fputs("{\"ok\": ", stdout);
        put_string(buf);
        fputs("}\n", stdout);
    } else if (!strcmp(fn, "nvmlDeviceGetUtilizationRates")) {
        util_t u = {0, 0};
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hutil)f)(HANDLE(0), &u);
        if (rc) nvml_err(rc);
        else printf("{\"ok\": {\"gpu\": %u, \"memory\": %u}}\n", u.gpu, u.memory);
    } else if (!strcmp(fn, "nvmlDeviceGetMemoryInfo")) {
        memory_t m = {0, 0, 0};
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hmem)f)(HANDLE(0), &m);
        if (rc) nvml_err(rc);
        else printf("{\"ok\": {\"total\": %llu, \"free\": %llu, \"used\": %llu}}\n", m.total, m.free, m.used);
    } else if (!strcmp(fn, "nvmlDeviceGetTemperature")) {
        unsigned int out = 0;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hip)f)(HANDLE(0), (int)args[1], &out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %u}\n", out);
    } else if (!strcmp(fn, "nvmlDeviceGetTotalEccErrors")) {
        unsigned long long out = 0;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hiipull)f)(HANDLE(0), (int)args[1], (int)args[2], &out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %llu}\n", out);
    } else if (!strcmp(fn, "nvmlEventSetCreate")) {
        void *out = NULL;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_pp)f)(&out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %llu}\n", (unsigned long long)(unsigned long)out);
    } else if (!strcmp(fn, "nvmlDeviceRegisterEvents")) {
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_hullp)f)(HANDLE(0), args[1], HANDLE(2));
        if (rc) nvml_err(rc); else fputs("{\"ok\": null}\n", stdout);
    } else if (!strcmp(fn, "nvmlEventSetWait")) {
        event_t e;
        memset(&e, 0, sizeof e);
        if (!(f = sym("nvmlEventSetWait_v2", &err))) { nvml_err(err); return; }
        rc = ((f_pevu)f)(HANDLE(0), &e, (unsigned int)args[1]);
        if (rc) { nvml_err(rc); return; }
        printf("{\"ok\": {\"device\": %llu, \"eventType\": %llu, \"eventData\": %llu, "
               "\"gpuInstanceId\": %u, \"computeInstanceId\": %u}}\n",
               (unsigned long long)(unsigned long)e.device, e.eventType, e.eventData,
               e.gpuInstanceId, e.computeInstanceId);
    } else if (!strcmp(fn, "nvmlEventSetFree")) {
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_p)f)(HANDLE(0));
        if (rc) nvml_err(rc); else fputs("{\"ok\": null}\n", stdout);
    } else if (!strcmp(fn, "nvmlSystemGetCudaDriverVersion")) {
        int out = 0;
        if (!(f = sym(fn, &err))) { nvml_err(err); return; }
        rc = ((f_i)f)(&out);
        if (rc) nvml_err(rc); else printf("{\"ok\": %d}\n", out);
    }
}

int main(void) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    signal(SIGINT, SIG_IGN);
    while ((n = getline(&line, &cap, stdin)) > 0) {
        const char *p = line;
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
        if (!*p && (size_t)n == strlen(line)) continue; /* a blank line */
        if (n > MAX_LINE) {
            answer_err(2, "bad request: the line is too long");
        } else if ((size_t)n != strlen(line)) {
            answer_err(2, "bad request: a NUL byte in the line");
        } else {
            char fn[128];
            unsigned long long args[MAX_ARGS];
            int nargs;
            const char *msg = NULL;
            if (parse(line, fn, sizeof fn, args, &nargs, &msg)) call(fn, args, nargs);
            else {
                char text[96];
                snprintf(text, sizeof text, "bad request: %s", msg);
                answer_err(2, text);
            }
        }
        if (fflush(stdout)) return 1;
    }
    free(line);
    return 0;
}
