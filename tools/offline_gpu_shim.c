/* A pretend GPU for tools/offline_compile.py: compiling for a GPU this machine does not have.
 *
 * torch's CUDA build asks the CUDA runtime, even for fake tensors, which device is current, its
 * properties and the current stream (autograd records the stream of every CUDA tensor that requires
 * grad); c10 asks the driver whether device 0 has a primary context; Triton's driver module links
 * against libcuda. Built at run time into the check's own folder as libcuda.so.1 and preloaded (so its
 * runtime functions come before libcudart's, and a dlopen of libcuda.so.1 finds it), it answers those
 * questions for one device whose properties come from the environment (OFFLINE_GPU_*, set by
 * offline_compile.py from its table of architectures). Memory is host memory (inductor's pattern
 * setup makes a few small real tensors); nothing is ever loaded or launched: a kernel launch through
 * libcudart fails as it would without a GPU, and loading a module returns CUDA_ERROR_NOT_SUPPORTED.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>

#define NOT_SUPPORTED 801 /* CUDA_ERROR_NOT_SUPPORTED */

static long env_number(const char *name) {
    const char *text = getenv(name);
    return text ? atol(text) : 0;
}

static int current_device = 0;
static char handles[1024]; /* distinct addresses for streams and events, never dereferenced */
static int next_handle = 0;

static void *new_handle(void) { return &handles[next_handle++ % (int)sizeof handles]; }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    const char *name = getenv("OFFLINE_GPU_NAME");
    snprintf(p->name, sizeof p->name, "%s", name ? name : "offline GPU");
    p->major = (int)env_number("OFFLINE_GPU_MAJOR");
    p->minor = (int)env_number("OFFLINE_GPU_MINOR");
    p->totalGlobalMem = (size_t)env_number("OFFLINE_GPU_MEMORY");
    p->multiProcessorCount = (int)env_number("OFFLINE_GPU_SMS");
    p->sharedMemPerBlockOptin = (size_t)env_number("OFFLINE_GPU_SHARED_PER_BLOCK");
    p->sharedMemPerMultiprocessor = (size_t)env_number("OFFLINE_GPU_SHARED_PER_SM");
    p->l2CacheSize = (int)env_number("OFFLINE_GPU_L2");
    p->sharedMemPerBlock = 49152;
    p->regsPerBlock = p->regsPerMultiprocessor = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsPerMultiProcessor = (int)env_number("OFFLINE_GPU_THREADS_PER_SM");
    p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536;
    p->unifiedAddressing = p->concurrentKernels = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attribute, int device) {
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return cudaErrorInvalidDevice;
    switch (attribute) {
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)p.sharedMemPerMultiprocessor; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = p.regsPerBlock; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = p.regsPerMultiprocessor; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    default: *value = 0;
    }
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *count) { *count = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *device) { *device = current_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    current_device = device;
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *version) { *version = CUDART_VERSION; return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) { *can = 0; return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
    *free_bytes = *total = (size_t)env_number("OFFLINE_GPU_MEMORY");
    return cudaSuccess;
}

/* streams and events: handles only; nothing ever runs on them */
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t *stream) { *stream = new_handle(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *stream, unsigned int flags, int priority) {
    *stream = new_handle();
    return cudaSuccess;
}
cudaError_t cudaStreamGetPriority(cudaStream_t stream, int *priority) { *priority = 0; return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) { *event = new_handle(); return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t event) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) { return cudaSuccess; }
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t event) { return cudaSuccess; }

/* memory: host memory behind the pretend device (inductor's pattern setup makes small real tensors) */
cudaError_t cudaMalloc(void **pointer, size_t size) {
    *pointer = malloc(size ? size : 1);
    return *pointer ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *pointer) { free(pointer); return cudaSuccess; }
cudaError_t cudaMemcpy(void *to, const void *from, size_t size, enum cudaMemcpyKind kind) {
    memcpy(to, from, size);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *to, const void *from, size_t size, enum cudaMemcpyKind kind, cudaStream_t stream) {
    memcpy(to, from, size);
    return cudaSuccess;
}

/* the driver API: c10's primary-context check (MaybeSetDevice), Triton's driver module */
int cuInit(unsigned int flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal == 0 ? 0 : 101; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    /* the driver's attribute numbers are the runtime's */
    return cudaDeviceGetAttribute(value, (enum cudaDeviceAttr)attribute, device) == cudaSuccess ? 0 : 101;
}
int cuDevicePrimaryCtxGetState(int device, unsigned int *flags, int *active) {
    *flags = 0;
    *active = 1;
    return 0;
}
int cuDevicePrimaryCtxRetain(void **context, int device) { *context = handles; return 0; }
int cuCtxGetCurrent(void **context) { *context = handles; return 0; }
int cuCtxSetCurrent(void *context) { return 0; }
int cuCtxGetLimit(size_t *value, int limit) { *value = 0; return 0; }
int cuCtxSetLimit(int limit, size_t value) { return 0; }
int cuGetErrorString(int error, const char **text) {
    *text = error == NOT_SUPPORTED ? "offline: nothing is loaded or launched" : "offline GPU error";
    return 0;
}
int cuModuleLoadData(void **module, const void *image) { return NOT_SUPPORTED; }
int cuModuleGetFunction(void **function, void *module, const char *name) { return NOT_SUPPORTED; }
int cuFuncGetAttribute(int *value, int attribute, void *function) { return NOT_SUPPORTED; }
int cuFuncSetAttribute(void *function, int attribute, int value) { return NOT_SUPPORTED; }
int cuFuncSetCacheConfig(void *function, int config) { return NOT_SUPPORTED; }
