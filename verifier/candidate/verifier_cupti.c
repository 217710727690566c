/* The device records of a candidate process: every kernel, copy and memset that ran on the GPU, and every
 * CUDA context, stream and graph launch created there, and every call that allocates or registers host
 * memory a kernel can reach, as CUPTI reports them (activity API: records written by the driver for work
 * that finished; callback API: context/stream creation, module loads, graph launches and host memory
 * calls as they happen).
 *
 * Built by the fork server (``device_records.build``) with the system C compiler and loaded there before
 * any worker is forked; each worker starts it after its CUDA context exists, before any candidate code.
 * No CUPTI header is needed: the few types and record layouts used are declared below (CUDA 13.0's
 * CUpti_ActivityKernel10, CUpti_ActivityMemcpy6, CUpti_ActivityMemset4, CUpti_CallbackData,
 * CUpti_ResourceData; ``tests/verifier/test_verifier_device_records.py`` checks the offsets against the
 * real header where one is installed). libcupti is opened with dlopen (the copy torch already loaded,
 * else the path given).
 *
 * The entries are read by the worker (``device_records.Collector``) after each flush and judged by the
 * checker (``device_evidence``); this code decides nothing.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VC_KERNEL 1
#define VC_MEMCPY 2
#define VC_MEMSET 3
#define VC_CONTEXT 4
#define VC_STREAM 5
#define VC_GRAPH_LAUNCH 6
#define VC_MODULE 7
#define VC_SYMBOL 8
#define VC_HOST_MEMORY 9

typedef struct {
  uint32_t type;
  uint32_t context;
  uint32_t stream;
  uint32_t copy_kind; /* memcpy: CUPTI's copy kind; graph launch, host memory: the callback id */
  uint64_t start, end;
  uint64_t bytes;     /* memcpy/memset bytes; module: cubin size; host memory: the bytes asked for */
  uint64_t graph;     /* the graph id a kernel/copy/memset ran from (0: none); module, symbol: module index */
  const char *name;   /* kernel: CUPTI's name (valid for the process's life); symbol: a copy of it */
} vc_entry;

/* CUPTI declarations (cupti_activity.h, cupti_callbacks.h, CUDA 13.0). */
typedef int CUptiResult;
typedef void *CUpti_SubscriberHandle;
typedef void (*vc_request_fn)(uint8_t **, size_t *, size_t *);
typedef void (*vc_complete_fn)(void *, uint32_t, uint8_t *, size_t, size_t);
typedef void (*vc_callback_fn)(void *, int, uint32_t, const void *);
enum {
  K_MEMCPY = 1, K_MEMSET = 2, K_KERNEL = 3, K_CONCURRENT_KERNEL = 10,
  D_DRIVER = 1, D_RUNTIME = 2, D_RESOURCE = 3,
  R_CONTEXT_CREATED = 1, R_STREAM_CREATED = 3, R_MODULE_LOADED = 6,
  RT_GRAPH_LAUNCH = 311, RT_GRAPH_LAUNCH_PTSZ = 312,
  DRV_GRAPH_LAUNCH = 514, DRV_GRAPH_LAUNCH_PTSZ = 515, /* cuGraphLaunch, cuGraphLaunch_ptsz */
  /* host memory a kernel can reach (cupti_driver_cbid.h, cupti_runtime_cbid.h): pinned, mapped,
   * registered or managed; each call's parameters hold its size at offset 8 */
  DRV_MEM_ALLOC_HOST = 37, DRV_MEM_HOST_ALLOC = 39, DRV_MEM_HOST_ALLOC_V2 = 271,
  DRV_MEM_ALLOC_HOST_V2 = 294, DRV_MEM_HOST_REGISTER = 301, DRV_MEM_ALLOC_MANAGED = 371,
  DRV_MEM_HOST_REGISTER_V2 = 379,
  RT_MALLOC_HOST = 25, RT_HOST_ALLOC = 27, RT_HOST_REGISTER = 152, RT_MALLOC_MANAGED = 206,
  ERR_MAX_LIMIT_REACHED = 12,
  FLUSH_FORCED = 1
};
/* record offsets */
#define KERNEL_START 16
#define KERNEL_END 24
#define KERNEL_CONTEXT 44
#define KERNEL_STREAM 48
#define KERNEL_NAME 104
#define KERNEL_GRAPH 156
#define COPY_KIND 4
#define COPY_BYTES 8
#define COPY_START 16
#define COPY_END 24
#define COPY_CONTEXT 36
#define COPY_STREAM 40
#define COPY_GRAPH 72

static struct {
  CUptiResult (*register_callbacks)(vc_request_fn, vc_complete_fn);
  CUptiResult (*enable)(int);
  CUptiResult (*next_record)(uint8_t *, size_t, void **);
  CUptiResult (*flush_all)(uint32_t);
  CUptiResult (*dropped)(void *, uint32_t, size_t *);
  CUptiResult (*subscribe)(CUpti_SubscriberHandle *, vc_callback_fn, void *);
  CUptiResult (*enable_domain)(uint32_t, CUpti_SubscriberHandle, int);
  CUptiResult (*enable_callback)(uint32_t, CUpti_SubscriberHandle, int, uint32_t);
  CUptiResult (*version)(uint32_t *);
  CUptiResult (*result_string)(CUptiResult, const char **);
  CUptiResult (*disable)(int);
  CUptiResult (*unsubscribe)(CUpti_SubscriberHandle);
} cupti;

#define BUFFER_BYTES (1 << 20)
#define MAX_ENTRIES (1 << 20)
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static vc_entry *entries;
static size_t n_entries, cap_entries;
static uint64_t dropped_records, overflow_entries, bad_records;
static CUpti_SubscriberHandle subscriber;
static int started, subscribed;
static char error[512];

static void push(const vc_entry *e) {
  pthread_mutex_lock(&lock);
  if (n_entries == cap_entries) {
    size_t cap = cap_entries ? 2 * cap_entries : 4096;
    vc_entry *grown = cap <= MAX_ENTRIES ? realloc(entries, cap * sizeof(vc_entry)) : NULL;
    if (grown == NULL) {
      overflow_entries++;
      pthread_mutex_unlock(&lock);
      return;
    }
    entries = grown;
    cap_entries = cap;
  }
  entries[n_entries++] = *e;
  pthread_mutex_unlock(&lock);
}

#define AT(T, p, off) (*(const T *)((const uint8_t *)(p) + (off)))

static void buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

/* One activity record as an entry (public for the unit tests: they feed synthetic records). */
int vc_record_entry(const void *r, vc_entry *e) {
  memset(e, 0, sizeof *e);
  uint32_t kind = AT(uint32_t, r, 0);
  if (kind == K_KERNEL || kind == K_CONCURRENT_KERNEL) {
    e->type = VC_KERNEL;
    e->start = AT(uint64_t, r, KERNEL_START);
    e->end = AT(uint64_t, r, KERNEL_END);
    e->context = AT(uint32_t, r, KERNEL_CONTEXT);
    e->stream = AT(uint32_t, r, KERNEL_STREAM);
    e->name = AT(const char *, r, KERNEL_NAME);
    e->graph = AT(uint32_t, r, KERNEL_GRAPH);
    return 1;
  }
  if (kind == K_MEMCPY || kind == K_MEMSET) {
    e->type = kind == K_MEMCPY ? VC_MEMCPY : VC_MEMSET;
    e->copy_kind = kind == K_MEMCPY ? AT(uint8_t, r, COPY_KIND) : 0;
    e->bytes = AT(uint64_t, r, COPY_BYTES);
    e->start = AT(uint64_t, r, COPY_START);
    e->end = AT(uint64_t, r, COPY_END);
    e->context = AT(uint32_t, r, COPY_CONTEXT);
    e->stream = AT(uint32_t, r, COPY_STREAM);
    e->graph = AT(uint32_t, r, COPY_GRAPH);
    return 1;
  }
  return 0;
}

static void buffer_completed(void *ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  void *record = NULL;
  vc_entry e;
  (void)size;
  while (cupti.next_record(buffer, valid, &record) == 0) {
    if (vc_record_entry(record, &e))
      push(&e);
  }
  size_t dropped = 0;
  if (cupti.dropped(ctx, stream, &dropped) == 0 && dropped) {
    pthread_mutex_lock(&lock);
    dropped_records += dropped;
    pthread_mutex_unlock(&lock);
  }
  free(buffer);
}

static uint64_t modules_loaded;

/* The global function symbols (kernels among them) of an ELF64 image, a cubin: one VC_SYMBOL entry each
 * (name copied, ``graph`` the module's index), so the worker can tell which loaded modules define a kernel
 * name. Everything is bounds-checked: the image may be anything a candidate loaded. Returns the count, or
 * -1 for an image that is not ELF64. Public for the unit tests. */
long vc_cubin_functions(const uint8_t *img, size_t size, uint64_t module) {
  if (img == NULL || size < 64 || memcmp(img, "\x7f" "ELF", 4) != 0 || img[4] != 2) return -1;
  uint64_t shoff = AT(uint64_t, img, 0x28);
  uint16_t shentsize = AT(uint16_t, img, 0x3A), shnum = AT(uint16_t, img, 0x3C);
  if (shentsize < 64 || shoff > size || (uint64_t)shnum * shentsize > size - shoff) return -1;
  long found = 0;
  for (uint16_t i = 0; i < shnum; i++) {
    const uint8_t *sh = img + shoff + (uint64_t)i * shentsize;
    if (AT(uint32_t, sh, 4) != 2) continue; /* SHT_SYMTAB */
    uint64_t off = AT(uint64_t, sh, 24), len = AT(uint64_t, sh, 32);
    uint32_t link = AT(uint32_t, sh, 40);
    if (off > size || len > size - off || link >= shnum) continue;
    const uint8_t *strsh = img + shoff + (uint64_t)link * shentsize;
    uint64_t soff = AT(uint64_t, strsh, 24), slen = AT(uint64_t, strsh, 32);
    if (soff > size || slen > size - soff) continue;
    for (uint64_t k = 0; k + 24 <= len; k += 24) {
      const uint8_t *sym = img + off + k;
      uint32_t name = AT(uint32_t, sym, 0);
      uint8_t info = sym[4];
      if ((info & 0xf) != 2 || (info >> 4) == 0 || name >= slen) continue; /* FUNC, not LOCAL */
      const char *text = (const char *)img + soff + name;
      size_t n = strnlen(text, slen - name);
      if (n == 0 || n == slen - name) continue; /* empty or unterminated */
      vc_entry e;
      memset(&e, 0, sizeof e);
      e.type = VC_SYMBOL;
      e.graph = module;
      e.name = strndup(text, n);
      if (e.name != NULL) {
        push(&e);
        found++;
      }
    }
  }
  return found;
}

static const uint32_t host_memory_apis[][2] = {
  {D_DRIVER, DRV_MEM_ALLOC_HOST}, {D_DRIVER, DRV_MEM_HOST_ALLOC}, {D_DRIVER, DRV_MEM_HOST_ALLOC_V2},
  {D_DRIVER, DRV_MEM_ALLOC_HOST_V2}, {D_DRIVER, DRV_MEM_HOST_REGISTER},
  {D_DRIVER, DRV_MEM_ALLOC_MANAGED}, {D_DRIVER, DRV_MEM_HOST_REGISTER_V2},
  {D_RUNTIME, RT_MALLOC_HOST}, {D_RUNTIME, RT_HOST_ALLOC}, {D_RUNTIME, RT_HOST_REGISTER},
  {D_RUNTIME, RT_MALLOC_MANAGED}};
#define N_HOST_MEMORY_APIS (sizeof host_memory_apis / sizeof host_memory_apis[0])

/* The entry of a driver or runtime API callback at API entry (``data``: CUpti_CallbackData): a host
 * memory call (its size read from ``functionParams``, offset 16: a size_t at offset 8 of every one of
 * them but the legacy cuMemAllocHost's unsigned int) or a graph launch. Returns 1 when ``e`` holds one,
 * 0 for anything else. Public for the unit tests: they feed synthetic callback data. */
int vc_api_entry(int domain, uint32_t cbid, const void *data, vc_entry *e) {
  memset(e, 0, sizeof *e);
  if (data == NULL || AT(uint32_t, data, 0) != 0) /* CUpti_CallbackData.callbackSite: API_ENTER only */
    return 0;
  for (size_t i = 0; i < N_HOST_MEMORY_APIS; i++) {
    if ((uint32_t)domain != host_memory_apis[i][0] || cbid != host_memory_apis[i][1]) continue;
    const void *params = AT(const void *, data, 16);
    e->type = VC_HOST_MEMORY;
    e->copy_kind = cbid;
    e->stream = (uint32_t)domain;
    if (params != NULL)
      e->bytes = domain == D_DRIVER && cbid == DRV_MEM_ALLOC_HOST ? AT(uint32_t, params, 8)
                                                                  : AT(uint64_t, params, 8);
    return 1;
  }
  e->type = VC_GRAPH_LAUNCH;
  e->copy_kind = cbid;
  return 1;
}

static void callback(void *user, int domain, uint32_t cbid, const void *data) {
  vc_entry e;
  (void)user;
  memset(&e, 0, sizeof e);
  if (domain == D_RESOURCE) {
    if (cbid == R_CONTEXT_CREATED) {
      e.type = VC_CONTEXT;
    } else if (cbid == R_STREAM_CREATED) {
      e.type = VC_STREAM;
    } else if (cbid == R_MODULE_LOADED) {
      const void *module = AT(const void *, data, 16); /* CUpti_ResourceData.resourceDescriptor */
      e.type = VC_MODULE;
      pthread_mutex_lock(&lock);
      e.graph = modules_loaded++;
      pthread_mutex_unlock(&lock);
      if (module != NULL) {
        e.bytes = AT(size_t, module, 8); /* cubinSize */
        vc_cubin_functions(AT(const uint8_t *, module, 16), (size_t)e.bytes, e.graph); /* pCubin */
      }
    } else {
      return;
    }
    push(&e);
    return;
  }
  if (vc_api_entry(domain, cbid, data, &e)) push(&e);
}

static int note(const char *what, CUptiResult rc) {
  const char *text = "";
  if (cupti.result_string != NULL) cupti.result_string(rc, &text);
  snprintf(error, sizeof error, "%s failed: CUPTI error %d %s", what, rc, text ? text : "");
  return rc ? rc : -1;
}

/* A failed start: give CUPTI back (the in-process profiler may take it) and say why. */
static int fail(const char *what, CUptiResult rc) {
  if (subscribed) {
    cupti.unsubscribe(subscriber);
    subscribed = 0;
  }
  return note(what, rc);
}

const char *vc_error(void) { return error; }

#define LOAD(field, symbol)                                                   \
  do {                                                                        \
    *(void **)&cupti.field = dlsym(lib, symbol);                              \
    if (cupti.field == NULL) {                                                \
      snprintf(error, sizeof error, "libcupti has no %s", symbol);            \
      return -1;                                                              \
    }                                                                         \
  } while (0)

/* Start recording (once per process). ``path``: libcupti to open when no copy is loaded yet. */
int vc_start(const char *path) {
  if (started) return 0;
  void *lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
  if (lib == NULL) lib = dlopen("libcupti.so", RTLD_NOW | RTLD_NOLOAD);
  if (lib == NULL && path != NULL && *path) lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    snprintf(error, sizeof error, "cannot open libcupti: %s", dlerror());
    return -1;
  }
  LOAD(register_callbacks, "cuptiActivityRegisterCallbacks");
  LOAD(enable, "cuptiActivityEnable");
  LOAD(next_record, "cuptiActivityGetNextRecord");
  LOAD(flush_all, "cuptiActivityFlushAll");
  LOAD(dropped, "cuptiActivityGetNumDroppedRecords");
  LOAD(subscribe, "cuptiSubscribe");
  LOAD(enable_domain, "cuptiEnableDomain");
  LOAD(enable_callback, "cuptiEnableCallback");
  LOAD(version, "cuptiGetVersion");
  LOAD(result_string, "cuptiGetResultString");
  LOAD(disable, "cuptiActivityDisable");
  LOAD(unsubscribe, "cuptiUnsubscribe");
  CUptiResult rc;
  if ((rc = cupti.subscribe(&subscriber, callback, NULL))) return fail("cuptiSubscribe", rc);
  subscribed = 1;
  if ((rc = cupti.enable_domain(1, subscriber, D_RESOURCE))) return fail("resource callbacks", rc);
  const uint32_t graph_launches[][2] = {
    {D_RUNTIME, RT_GRAPH_LAUNCH}, {D_RUNTIME, RT_GRAPH_LAUNCH_PTSZ},
    {D_DRIVER, DRV_GRAPH_LAUNCH}, {D_DRIVER, DRV_GRAPH_LAUNCH_PTSZ}};
  for (size_t i = 0; i < sizeof graph_launches / sizeof graph_launches[0]; i++)
    if ((rc = cupti.enable_callback(1, subscriber, (int)graph_launches[i][0], graph_launches[i][1])))
      return fail("graph launch callbacks", rc);
  for (size_t i = 0; i < N_HOST_MEMORY_APIS; i++)
    if ((rc = cupti.enable_callback(1, subscriber, (int)host_memory_apis[i][0], host_memory_apis[i][1])))
      return fail("host memory callbacks", rc);
  if ((rc = cupti.register_callbacks(buffer_requested, buffer_completed)))
    return fail("cuptiActivityRegisterCallbacks", rc);
  const int kinds[] = {K_CONCURRENT_KERNEL, K_MEMCPY, K_MEMSET};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    if ((rc = cupti.enable(kinds[i]))) return fail("cuptiActivityEnable", rc);
  started = 1;
  return 0;
}

/* Stop recording and give CUPTI back (a failed self-test: the in-process profiler may take it). */
int vc_stop(void) {
  if (!started) return 0;
  const int kinds[] = {K_CONCURRENT_KERNEL, K_MEMCPY, K_MEMSET};
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) cupti.disable(kinds[i]);
  cupti.flush_all(FLUSH_FORCED);
  cupti.unsubscribe(subscriber);
  started = subscribed = 0;
  return 0;
}

/* Deliver every finished record (forced flush); returns the entries waiting. */
long vc_flush(void) {
  if (!started) return -1;
  CUptiResult rc = cupti.flush_all(FLUSH_FORCED);
  if (rc) return -(long)note("cuptiActivityFlushAll", rc);
  pthread_mutex_lock(&lock);
  long n = (long)n_entries;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Move up to ``max`` entries into ``out`` (oldest first); returns how many. */
long vc_take(vc_entry *out, long max) {
  pthread_mutex_lock(&lock);
  long n = (long)n_entries < max ? (long)n_entries : max;
  memcpy(out, entries, (size_t)n * sizeof(vc_entry));
  memmove(entries, entries + n, (n_entries - (size_t)n) * sizeof(vc_entry));
  n_entries -= (size_t)n;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Records CUPTI dropped plus entries that did not fit, since the start. */
uint64_t vc_lost(void) {
  pthread_mutex_lock(&lock);
  uint64_t n = dropped_records + overflow_entries + bad_records;
  pthread_mutex_unlock(&lock);
  return n;
}

uint32_t vc_version(void) {
  uint32_t v = 0;
  if (cupti.version != NULL) cupti.version(&v);
  return v;
}

size_t vc_entry_size(void) { return sizeof(vc_entry); }
