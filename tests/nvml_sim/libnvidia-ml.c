/* A simulated libnvidia-ml.so.1 for kvprof's tests: the real pynvml loads it through
 * LD_LIBRARY_PATH, so the real ctypes calls, struct layouts and error mapping run.
 *
 * It replays a script (file named by NVSIM_SCRIPT), one line per segment:
 *     t_start_ms t_end_ms gpu phase        phase: prefill | decode | idle
 *     t_start_ms -        gpu lost         from t_start_ms on, every call on that GPU fails
 * Times are CLOCK_MONOTONIC since nvmlInit; time outside any segment is idle. Comments: '#'.
 * NVSIM_T0_FILE, if set, receives that CLOCK_MONOTONIC origin in ns, so a test can map the
 * script onto the sampler's clock. NVSIM_ORIGIN=first_read moves that origin to the first
 * utilisation reading (until then the script's time stands at 0): a recorder opens NVML before
 * it compiles its probes (seconds, more on a loaded machine) and reads only once they are
 * attached, and the script is what the GPUs do while they are watched. NVSIM_INIT_FAIL=1 makes nvmlInit fail as without a driver.
 * NVSIM_PCIE_DELAY_US makes nvmlDeviceGetPcieThroughput block, as the real one does.
 *
 * Three GPUs that fail differently:
 *   GPU0  everything, GPM included
 *   GPU1  no GPM, no power reading (NVML_ERROR_NOT_SUPPORTED)
 *   GPU2  everything, until its "lost" line: then NVML_ERROR_GPU_IS_LOST
 *
 * Values follow the phase (prefill: tensor-heavy, high power; decode: DRAM-heavy, tensor
 * low; idle: near zero) with deterministic noise. Like the driver, readings are averages over
 * a recent window (utilisation 1/6 s, power 100 ms, GPM the span between its two samples), so
 * a reading that straddles a phase change is a mix; GPM windows under 100 ms read NaN.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

/* Struct layouts as pynvml declares them (c_nvmlUtilization_t, c_nvmlGpmSupport_t, ...). */
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct { const char *shortName, *longName, *unit; } nvmlGpmMetricInfo_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;
typedef struct gpm_sample { long long t_ns; int gpu; } *nvmlGpmSample_t;
typedef struct {
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[];  /* pynvml allocates NVML_GPM_METRIC_MAX; we use numMetrics */
} nvmlGpmMetricsGet_t;

#define NGPU 3
#define MAX_SEGMENTS 1024
#define UTIL_WINDOW_MS 166.0
#define POWER_WINDOW_MS 100.0
#define GPM_MIN_WINDOW_NS 100000000LL

enum phase { IDLE, PREFILL, DECODE, NPHASE };
enum metric { SM, TENSOR, DRAM, GPU_UTIL, MEM_UTIL, POWER_W, PCIE_RX_MIB, PCIE_TX_MIB, NMETRIC };

static const double level[NPHASE][NMETRIC] = {
    /*            SM  TENSOR DRAM GPU_UTIL MEM_UTIL POWER_W  RX_MIB  TX_MIB */
    [IDLE]    = { 0.5,  0.0,  0.5,   0.0,     0.0,    70.0,    1.0,    1.0},
    [PREFILL] = {88.0, 62.0, 38.0,  99.0,    38.0,   610.0, 2000.0,  300.0},
    [DECODE]  = {62.0,  9.0, 82.0,  97.0,    74.0,   430.0,  200.0,  100.0},
};
static const int is_pct[NMETRIC] = {1, 1, 1, 1, 1, 0, 0, 0};
static const struct { int gpm, power; } caps[NGPU] = {{1, 1}, {0, 0}, {1, 1}};

struct segment { long start_ms, end_ms; int gpu; enum phase phase; };
static struct segment segments[MAX_SEGMENTS];
static int nsegments;
static long lost_at_ms[NGPU] = {-1, -1, -1};
static long long t0_ns;
static int initialised;
static struct device { int index; } devices[NGPU] = {{0}, {1}, {2}};

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int origin_pending; /* NVSIM_ORIGIN=first_read, before that reading */

static double now_ms(void) { return origin_pending ? 0 : (mono_ns() - t0_ns) / 1e6; }

static void set_origin(void) {
    t0_ns = mono_ns();
    const char *t0_file = getenv("NVSIM_T0_FILE");
    FILE *f = t0_file ? fopen(t0_file, "w") : NULL;
    if (f) { fprintf(f, "%lld\n", t0_ns); fclose(f); }
}

static int parse_phase(const char *s, enum phase *out) {
    static const char *names[NPHASE] = {"idle", "prefill", "decode"};
    for (int p = 0; p < NPHASE; p++)
        if (strcmp(s, names[p]) == 0) { *out = (enum phase)p; return 1; }
    return 0;
}

static void load_script(const char *path) {
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[256], end[32], what[32];
    long start;
    int gpu;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#' || sscanf(line, "%ld %31s %d %31s", &start, end, &gpu, what) != 4)
            continue;
        if (gpu < 0 || gpu >= NGPU) continue;
        if (strcmp(what, "lost") == 0) { lost_at_ms[gpu] = start; continue; }
        struct segment s = {start, atol(end), gpu, IDLE};
        if (nsegments < MAX_SEGMENTS && parse_phase(what, &s.phase)) segments[nsegments++] = s;
    }
    fclose(f);
}

static enum phase phase_at(int gpu, double t_ms) {
    enum phase p = IDLE;
    for (int i = 0; i < nsegments; i++)  /* later lines win */
        if (segments[i].gpu == gpu && t_ms >= segments[i].start_ms && t_ms < segments[i].end_ms)
            p = segments[i].phase;
    return p;
}

/* -1..1, the same for the same GPU, metric and 10 ms slot on every run. */
static double noise(int gpu, int m, long slot) {
    uint64_t x = (uint64_t)slot * 0x9E3779B97F4A7C15ULL ^ (uint64_t)(gpu * 131 + m) << 40;
    x ^= x >> 33; x *= 0xFF51AFD7ED558CCDULL; x ^= x >> 33;
    return (double)(x % 20001) / 10000.0 - 1.0;
}

static double value_at(int gpu, enum metric m, double t_ms) {
    double v = level[phase_at(gpu, t_ms)][m];
    double n = noise(gpu, m, (long)floor(t_ms / 10.0));
    v = v * (1.0 + 0.04 * n) + 0.5 * n;
    if (v < 0) v = 0;
    if (is_pct[m] && v > 100) v = 100;
    return v;
}

/* The driver reports averages: the mean over [a, b] ms in 1 ms steps. */
static double mean_over(int gpu, enum metric m, double a_ms, double b_ms) {
    if (a_ms < 0) a_ms = 0;
    if (b_ms <= a_ms) return value_at(gpu, m, b_ms);
    double sum = 0;
    int n = 0;
    for (double t = a_ms; t < b_ms; t += 1.0, n++) sum += value_at(gpu, m, t);
    return sum / n;
}

static double recent(int gpu, enum metric m, double window_ms) {
    double t = now_ms();
    return mean_over(gpu, m, t - window_ms, t);
}

static int lost(int gpu) { return lost_at_ms[gpu] >= 0 && now_ms() >= lost_at_ms[gpu]; }

/* Every device call starts here: the handle must be ours and its GPU still on the bus. */
#define DEVICE(h, var)                                                              \
    if (!initialised) return NVML_ERROR_UNINITIALIZED;                                \
    struct device *var = (struct device *)(h);                                        \
    if (var < devices || var >= devices + NGPU) return NVML_ERROR_INVALID_ARGUMENT;   \
    if (lost(var->index)) return NVML_ERROR_GPU_IS_LOST;

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *fail = getenv("NVSIM_INIT_FAIL");
    if (fail && strcmp(fail, "1") == 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (initialised++) return NVML_SUCCESS;  /* nested init, as the real library counts */
    load_script(getenv("NVSIM_SCRIPT"));
    const char *origin = getenv("NVSIM_ORIGIN");
    origin_pending = origin && strcmp(origin, "first_read") == 0;
    if (!origin_pending) set_origin();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "999.99-nvsim");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = NGPU;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, struct device **handle) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= NGPU) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(index)) return NVML_ERROR_GPU_IS_LOST;
    *handle = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(struct device *h, char *uuid, unsigned int length) {
    DEVICE(h, d);
    snprintf(uuid, length, "GPU-5151c0de-0000-4000-8000-00000000000%d", d->index);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(struct device *h, nvmlUtilization_t *u) {
    if (origin_pending) { origin_pending = 0; set_origin(); }
    DEVICE(h, d);
    u->gpu = (unsigned int)lround(recent(d->index, GPU_UTIL, UTIL_WINDOW_MS));
    u->memory = (unsigned int)lround(recent(d->index, MEM_UTIL, UTIL_WINDOW_MS));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(struct device *h, unsigned int *milliwatts) {
    DEVICE(h, d);
    if (!caps[d->index].power) return NVML_ERROR_NOT_SUPPORTED;
    *milliwatts = (unsigned int)lround(1000.0 * recent(d->index, POWER_W, POWER_WINDOW_MS));
    return NVML_SUCCESS;
}

/* counter 0 = TX, 1 = RX (nvmlPcieUtilCounter_t); KiB/s over the last 20 ms. */
nvmlReturn_t nvmlDeviceGetPcieThroughput(struct device *h, unsigned int counter,
                                         unsigned int *kib_per_s) {
    DEVICE(h, d);
    if (counter > 1) return NVML_ERROR_INVALID_ARGUMENT;
    const char *delay = getenv("NVSIM_PCIE_DELAY_US");
    if (delay) usleep((useconds_t)atol(delay));
    enum metric m = counter == 0 ? PCIE_TX_MIB : PCIE_RX_MIB;
    *kib_per_s = (unsigned int)lround(1024.0 * recent(d->index, m, 20.0));
    return NVML_SUCCESS;
}

/* Two processes share a busy GPU; NOT_FOUND when none has a sample newer than last_seen_us. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(struct device *h,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count,
                                             unsigned long long last_seen_us) {
    DEVICE(h, d);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    unsigned long long now_us = wall.tv_sec * 1000000ULL + wall.tv_nsec / 1000;
    double sm = recent(d->index, SM, UTIL_WINDOW_MS);
    if (sm < 5.0 || last_seen_us >= now_us) return NVML_ERROR_NOT_FOUND;
    if (!samples || *count < 2) { *count = 2; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (int k = 0; k < 2; k++) {
        nvmlProcessUtilizationSample_t s = {
            .pid = 4100 + 10 * d->index + k, .timeStamp = now_us,
            .smUtil = (unsigned int)lround(sm * (k == 0 ? 0.7 : 0.3)),
            .memUtil = (unsigned int)lround(recent(d->index, MEM_UTIL, UTIL_WINDOW_MS) / 2)};
        samples[k] = s;
    }
    *count = 2;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(struct device *h, nvmlGpmSupport_t *support) {
    DEVICE(h, d);
    if (support->version != 1) return NVML_ERROR_INVALID_ARGUMENT;
    support->isSupportedDevice = (unsigned int)caps[d->index].gpm;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *sample = calloc(1, sizeof **sample);
    if (!*sample) return NVML_ERROR_UNKNOWN;
    (*sample)->gpu = -1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    free(sample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(struct device *h, nvmlGpmSample_t sample) {
    DEVICE(h, d);
    if (!caps[d->index].gpm) return NVML_ERROR_NOT_SUPPORTED;
    sample->t_ns = mono_ns();
    sample->gpu = d->index;
    return NVML_SUCCESS;
}

static int gpm_metric(unsigned int id, enum metric *m) {
    switch (id) {
    case 2: *m = SM; return 1;            /* NVML_GPM_METRIC_SM_UTIL */
    case 5: *m = TENSOR; return 1;        /* NVML_GPM_METRIC_ANY_TENSOR_UTIL */
    case 10: *m = DRAM; return 1;         /* NVML_GPM_METRIC_DRAM_BW_UTIL */
    case 20: *m = PCIE_TX_MIB; return 1;  /* NVML_GPM_METRIC_PCIE_TX_PER_SEC */
    case 21: *m = PCIE_RX_MIB; return 1;  /* NVML_GPM_METRIC_PCIE_RX_PER_SEC */
    default: return 0;
    }
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *req) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (req->version != 1 || !req->sample1 || !req->sample2) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlGpmSample_t a = req->sample1, b = req->sample2;
    if (a->gpu < 0 || a->gpu != b->gpu) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(a->gpu)) return NVML_ERROR_GPU_IS_LOST;
    double from_ms = (a->t_ns - t0_ns) / 1e6, to_ms = (b->t_ns - t0_ns) / 1e6;
    int too_short = llabs(b->t_ns - a->t_ns) < GPM_MIN_WINDOW_NS;
    for (unsigned int i = 0; i < req->numMetrics; i++) {
        nvmlGpmMetric_t *out = &req->metrics[i];
        enum metric m;
        if (!gpm_metric(out->metricId, &m)) { out->nvmlReturn = NVML_ERROR_NOT_SUPPORTED; continue; }
        out->nvmlReturn = NVML_SUCCESS;
        out->value = too_short ? NAN : mean_over(a->gpu, m, fmin(from_ms, to_ms), fmax(from_ms, to_ms));
        out->metricInfo.shortName = out->metricInfo.longName = "nvsim";
        out->metricInfo.unit = is_pct[m] ? "%" : "MiB/s";
    }
    return NVML_SUCCESS;
}
