// CUDA runtime side of offtensor's native extension: device count, host-memory registration and the
// host->device copy engine (one non-blocking stream per device, one event per copy).
//
// Only the CUDA runtime is used, no torch headers, so this compiles wherever nvcc exists and links
// into a CPU build of torch. The interface is runtime.h; errors travel back as negative codes.
#include "runtime.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <vector>

namespace {

// Runs the body with `device` current and restores the caller's device afterwards, because torch
// keeps its own notion of the current device on this thread.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t status_;
};

struct DeviceCopyState {
  cudaStream_t stream = nullptr;
  // Records the caller's stream so the copy stream starts after work already enqueued there
  // (e.g. the last reader of a slot buffer the copy overwrites). Reusable at once: a wait
  // captures the event's state when cudaStreamWaitEvent is called.
  cudaEvent_t caller_done = nullptr;
  std::vector<cudaEvent_t> free_events;  // events are tied to a device, so the pool is per device
};

struct PendingCopy {
  int device;
  cudaEvent_t done;
};

std::mutex g_mutex;
std::vector<DeviceCopyState> g_devices;
std::map<int64_t, PendingCopy> g_pending;  // ordered by ticket, i.e. by submission order
int64_t g_next_ticket = 1;

int fail(cudaError_t status) {
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  return -static_cast<int>(status);
}

// Caller holds g_mutex.
cudaError_t device_state(int device, DeviceCopyState** out) {
  if (device < 0) return cudaErrorInvalidDevice;
  if (static_cast<size_t>(device) >= g_devices.size()) g_devices.resize(device + 1);
  DeviceCopyState& state = g_devices[device];
  if (state.stream == nullptr) {
    cudaError_t status = cudaStreamCreateWithFlags(&state.stream, cudaStreamNonBlocking);
    if (status != cudaSuccess) {
      state.stream = nullptr;
      return status;
    }
    status = cudaEventCreateWithFlags(&state.caller_done, cudaEventDisableTiming);
    if (status != cudaSuccess) {
      cudaStreamDestroy(state.stream);
      state.stream = nullptr;
      state.caller_done = nullptr;
      return status;
    }
  }
  *out = &state;
  return cudaSuccess;
}

// Caller holds g_mutex. Copies on one stream finish in order, so once `ticket` has finished every
// earlier ticket of the same device has too: their events go back to the pool.
void retire_through(int64_t ticket, int device) {
  for (auto it = g_pending.begin(); it != g_pending.end() && it->first <= ticket;) {
    if (it->second.device == device) {
      g_devices[device].free_events.push_back(it->second.done);
      it = g_pending.erase(it);
    } else {
      ++it;
    }
  }
}

// Caller holds g_mutex. Keeps g_pending small for callers that never query old tickets.
void retire_finished(int device) {
  int64_t newest_finished = 0;
  for (const auto& [ticket, copy] : g_pending) {
    if (copy.device != device) continue;
    if (cudaEventQuery(copy.done) != cudaSuccess) break;
    newest_finished = ticket;
  }
  cudaGetLastError();
  if (newest_finished > 0) retire_through(newest_finished, device);
}

}  // namespace

extern "C" int ot_cuda_device_count(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

extern "C" int ot_cuda_host_register(void* ptr, size_t nbytes) {
  // Portable: the memory counts as pinned in every CUDA context, not only the current device's, so
  // copies to any GPU of a multi-GPU box are DMA transfers.
  cudaError_t status = cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable);
  return status == cudaSuccess ? 0 : fail(status);
}

extern "C" int ot_cuda_host_unregister(void* ptr) {
  cudaError_t status = cudaHostUnregister(ptr);
  // Memory freed at process exit may outlive the runtime, whose unloading drops the registration.
  if (status == cudaErrorCudartUnloading) return 0;
  return status == cudaSuccess ? 0 : fail(status);
}

extern "C" int64_t ot_cuda_copy_async(int device, void* dst, const void* src, size_t nbytes,
                                      void* wait_stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return fail(guard.status());
  DeviceCopyState* state = nullptr;
  cudaError_t status = device_state(device, &state);
  if (status != cudaSuccess) return fail(status);
  retire_finished(device);

  // A non-blocking stream does not synchronise with the legacy default stream by itself, so NULL
  // (torch's default stream) is waited for like any other.
  status = cudaEventRecord(state->caller_done, static_cast<cudaStream_t>(wait_stream));
  if (status == cudaSuccess) status = cudaStreamWaitEvent(state->stream, state->caller_done, 0);
  if (status != cudaSuccess) return fail(status);
  // cudaMemcpyDefault lets unified addressing pick the direction (H2D, D2D or D2H).
  if (nbytes > 0) {
    status = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, state->stream);
    if (status != cudaSuccess) return fail(status);
  }
  cudaEvent_t done;
  if (state->free_events.empty()) {
    status = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (status != cudaSuccess) return fail(status);
  } else {
    done = state->free_events.back();
    state->free_events.pop_back();
  }
  status = cudaEventRecord(done, state->stream);
  if (status != cudaSuccess) {
    state->free_events.push_back(done);
    return fail(status);
  }
  const int64_t ticket = g_next_ticket++;
  g_pending.emplace(ticket, PendingCopy{device, done});
  return ticket;
}

extern "C" int ot_cuda_query(int64_t ticket) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (ticket <= 0 || ticket >= g_next_ticket) return fail(cudaErrorInvalidValue);
  auto it = g_pending.find(ticket);
  if (it == g_pending.end()) return 1;  // retired earlier, so finished
  cudaError_t status = cudaEventQuery(it->second.done);
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return 0;
  }
  if (status != cudaSuccess) return fail(status);
  retire_through(ticket, it->second.device);
  return 1;
}

extern "C" int ot_cuda_stream_wait(int64_t ticket, void* stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (ticket <= 0 || ticket >= g_next_ticket) return fail(cudaErrorInvalidValue);
  auto it = g_pending.find(ticket);
  if (it == g_pending.end()) return 0;  // finished: nothing to wait for
  cudaError_t status = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), it->second.done, 0);
  return status == cudaSuccess ? 0 : fail(status);
}

extern "C" int ot_cuda_sync(int64_t ticket) {
  cudaEvent_t done;
  int device;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (ticket <= 0 || ticket >= g_next_ticket) return fail(cudaErrorInvalidValue);
    auto it = g_pending.find(ticket);
    if (it == g_pending.end()) return 0;
    done = it->second.done;
    device = it->second.device;
  }
  // Block without the lock so other threads can submit meanwhile. Should another thread retire
  // and re-record this event for a later copy on the same stream, we only wait longer.
  cudaError_t status = cudaEventSynchronize(done);
  if (status != cudaSuccess) return fail(status);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_pending.count(ticket) != 0) retire_through(ticket, device);
  return 0;
}

extern "C" const char* ot_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code < 0 ? -code : code));
}

// ---------------------------------------------------------------- the expert pool's masked gather

namespace {

// One block per (row, chunk of the row): a row whose destination is not a slot returns at once, so
// hits copy nothing. Rows are read from pinned host memory through its device address (UVA), 16
// bytes at a time where both ends allow it.
__global__ void masked_row_gather_kernel(char* dst, const char* src, const int64_t* dest, int64_t slots,
                                         size_t row_bytes, size_t chunk_bytes) {
  const int64_t row = blockIdx.x;
  const int64_t slot = dest[row];
  if (slot < 0 || slot >= slots) return;
  const size_t begin = static_cast<size_t>(blockIdx.y) * chunk_bytes;
  if (begin >= row_bytes) return;
  const size_t end = begin + chunk_bytes < row_bytes ? begin + chunk_bytes : row_bytes;
  const char* from = src + static_cast<size_t>(row) * row_bytes;
  char* to = dst + static_cast<size_t>(slot) * row_bytes;
  const bool aligned = ((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) | begin | end) & 15) == 0;
  if (aligned) {
    const uint4* f = reinterpret_cast<const uint4*>(from + begin);
    uint4* t = reinterpret_cast<uint4*>(to + begin);
    for (size_t i = threadIdx.x; i < (end - begin) / 16; i += blockDim.x) t[i] = f[i];
  } else {
    for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace

extern "C" int ot_cuda_masked_row_gather(int device, void* dst, const void* src, const int64_t* dest, int64_t rows,
                                         int64_t slots, size_t row_bytes, void* stream) {
  if (rows <= 0 || row_bytes == 0) return 0;
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return -static_cast<int>(guard.status());
  void* device_src = nullptr;
  cudaError_t status = cudaHostGetDevicePointer(&device_src, const_cast<void*>(src), 0);
  if (status != cudaSuccess) return -static_cast<int>(status);
  const size_t chunk_bytes = 1 << 16;  // 64 KiB per block
  const size_t chunks = (row_bytes + chunk_bytes - 1) / chunk_bytes;
  if (chunks > 65535) return -static_cast<int>(cudaErrorInvalidValue);
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  masked_row_gather_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<char*>(dst), static_cast<const char*>(device_src), dest, slots, row_bytes, chunk_bytes);
  status = cudaGetLastError();
  return status == cudaSuccess ? 0 : -static_cast<int>(status);
}

extern "C" int ot_cuda_host_device_pointer(const void* host, void** device_ptr) {
  const cudaError_t status = cudaHostGetDevicePointer(device_ptr, const_cast<void*>(host), 0);
  return status == cudaSuccess ? 0 : -static_cast<int>(status);
}
