// Host memory: exact-size, page-aligned allocations (alloc_host), pinned at once or after they are
// filled (pin_host), freed once, and the device address of a pinned one (host_device_address).
// A part of offtensor.cpp's one translation unit, included there once: every file that includes ATen
// costs about a minute to compile on a 2-core build machine, so the extension's ATen code stays one
// unit, kept in files by idea. Its functions have internal linkage (an unnamed namespace).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <vector>

#include "ops_common.h"

namespace offtensor {
namespace {

// ---------------------------------------------------------------------------------------------
// Host memory
// ---------------------------------------------------------------------------------------------

// Requested (not page-rounded) bytes of every alloc_host allocation still alive.
std::atomic<int64_t> g_live_host_bytes{0};

// Transparent huge pages only cover whole 2 MiB pages, so smaller regions gain nothing.
constexpr size_t kHugePageBytes = size_t(2) << 20;
// Below this a single thread faults pages in faster than threads can be started.
constexpr size_t kParallelTouchBytes = size_t(16) << 20;
constexpr size_t kMinBytesPerToucher = size_t(8) << 20;
constexpr unsigned kMaxTouchers = 8;

// Faults every page in now, from several threads: the kernel zeroes pages on first write, which is
// most of the cost of a large allocation and scales with cores, and cudaHostRegister would
// otherwise fault them in one by one on a single thread.
void touch_pages_in_parallel(char* base, size_t nbytes, size_t page_bytes) {
  const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t touchers =
      std::min<size_t>({hardware, kMaxTouchers, std::max<size_t>(1, nbytes / kMinBytesPerToucher)});
  const size_t pages = (nbytes + page_bytes - 1) / page_bytes;
  const size_t pages_per_toucher = (pages + touchers - 1) / touchers;
  auto touch = [=](size_t first_page, size_t end_page) {
    volatile char* bytes = base;
    for (size_t page = first_page; page < end_page; ++page) bytes[page * page_bytes] = 0;
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < touchers; ++t) {
    const size_t first = t * pages_per_toucher;
    const size_t end = std::min(pages, first + pages_per_toucher);
    if (first >= end) break;
    try {
      threads.emplace_back(touch, first, end);
    } catch (const std::system_error&) {
      touch(first, end);  // no thread available: still correct, only slower
    }
  }
  touch(0, std::min(pages, pages_per_toucher));
  for (auto& thread : threads) thread.join();
}

#ifdef OFFTENSOR_WITH_CUDA
// Allocations that pin_host registered after they were filled; their deleter was made before that,
// so free_host looks them up here to unregister them.
std::mutex g_late_pinned_mutex;
std::unordered_set<void*> g_late_pinned;  // base pointers

bool forget_late_pinning(void* ptr) {
  std::lock_guard<std::mutex> lock(g_late_pinned_mutex);
  return g_late_pinned.erase(ptr) != 0;
}
#endif

void free_host(void* ptr, size_t mapped_bytes, int64_t nbytes, bool registered) {
#ifdef OFFTENSOR_WITH_CUDA
  if (registered || forget_late_pinning(ptr)) {
    const int result = ot_cuda_host_unregister(ptr);
    if (result < 0) {  // a deleter cannot throw
      std::fprintf(stderr, "offtensor: cudaHostUnregister of %lld bytes at %p failed: %s\n",
                   static_cast<long long>(nbytes), ptr, ot_cuda_error_string(-result));
    }
  }
#else
  (void)registered;
#endif
  munmap(ptr, mapped_bytes);
  g_live_host_bytes.fetch_sub(nbytes);
}

// Exactly nbytes of page-aligned host memory as a 1-D uint8 tensor. Only the mapping is rounded,
// to the OS page: allocators that round to powers of two can double the memory that large
// offloaded weights cost. The memory is returned to the OS when the last tensor using it dies.
// touch=false leaves the pages unfaulted and without huge-page advice, for a caller that fills the
// memory right away (a read from a file faults each page once, while writing it); pin_host can
// then pin it once filled.
at::Tensor alloc_host(c10::SymInt sym_nbytes, bool pin, bool touch) {
  const int64_t nbytes = sym_nbytes.expect_int();
  TORCH_CHECK(nbytes >= 0, "offtensor.alloc_host: nbytes must be >= 0, got ", nbytes);
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  if (nbytes == 0) return at::empty({0}, options);  // mmap rejects empty mappings

  const size_t page_bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t mapped_bytes = (static_cast<size_t>(nbytes) + page_bytes - 1) / page_bytes * page_bytes;
  void* ptr = mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(ptr != MAP_FAILED, "offtensor: could not allocate ", nbytes,
              " bytes of host memory: ", std::strerror(errno));
  // Huge pages cut TLB misses and page-fault counts for multi-GB weights, and make registering
  // them with the driver cheaper: only for memory about to be pinned for a GPU. THP may be disabled
  // on this machine, in which case madvise fails and ordinary pages are fine. Not for touch=false:
  // memory filled by a load is always fresh, and a first fault on fresh huge-page memory may
  // compact memory synchronously (defrag=madvise). Not for unpinned memory (the emulated device):
  // on the CPU test VM (a Firecracker guest) a fresh process filled huge-page masters at
  // 0.35-0.9 GB/s against 1.7-2.3 GB/s with 4 KiB pages (guest huge pages come from memory the
  // host has never backed), and a memcpy reading a master gains little from fewer TLB misses.
  bool will_register = false;
#ifdef OFFTENSOR_WITH_CUDA
  will_register = pin && cuda_device_count() > 0;
#endif
  if (touch && will_register && mapped_bytes >= kHugePageBytes) madvise(ptr, mapped_bytes, MADV_HUGEPAGE);
  if (touch && mapped_bytes >= kParallelTouchBytes) {
    touch_pages_in_parallel(static_cast<char*>(ptr), mapped_bytes, page_bytes);
  }

  bool registered = false;
#ifdef OFFTENSOR_WITH_CUDA
  if (pin && cuda_device_count() > 0) {
    const int result = ot_cuda_host_register(ptr, mapped_bytes);
    if (result < 0) {
      munmap(ptr, mapped_bytes);
      TORCH_CHECK(false, "offtensor: could not pin ", nbytes, " bytes of host memory (cudaHostRegister: ",
                  ot_cuda_error_string(-result), "). Check `ulimit -l`, or allocate with pin=False.");
    }
    registered = true;
  }
#else
  (void)pin;  // without CUDA there is nothing to pin for; _ext.py falls back to torch when a GPU exists
#endif

  g_live_host_bytes.fetch_add(nbytes);
  return at::from_blob(
      ptr, {nbytes},
      [mapped_bytes, nbytes, registered](void* data) { free_host(data, mapped_bytes, nbytes, registered); },
      options);
}

int64_t live_host_bytes() { return g_live_host_bytes.load(); }

// Pins (cudaHostRegister) the whole allocation behind host, an alloc_host tensor made with
// pin=false, after it has been filled: registering touched pages only locks them, while
// registering fresh ones faults them in on one thread. Its deleter unregisters it. Returns
// whether the memory is pinned now: false without a GPU (nothing to pin for).
bool pin_host(const at::Tensor& host) {
  TORCH_CHECK(host.is_cpu(), "offtensor.pin_host: expected a CPU tensor from alloc_host, got one on ", host.device());
  const auto& storage = host.storage();
  void* base = storage.mutable_data();
  const size_t nbytes = storage.nbytes();
  if (nbytes == 0) return false;
  const size_t page_bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % page_bytes == 0, "offtensor.pin_host: the storage of ", nbytes,
              " bytes at ", base, " is not page-aligned, so it is not an alloc_host allocation");
#ifdef OFFTENSOR_WITH_CUDA
  if (cuda_device_count() == 0) return false;
  const size_t mapped_bytes = (nbytes + page_bytes - 1) / page_bytes * page_bytes;
  // cudaErrorHostMemoryAlreadyRegistered: allocated with pin=true, or pinned before.
  constexpr int kAlreadyRegistered = 712;
  int result;
  {
    GilRelease no_gil;
    result = ot_cuda_host_register(base, mapped_bytes);
  }
  if (result == -kAlreadyRegistered) return true;
  TORCH_CHECK(result >= 0, "offtensor: could not pin ", nbytes, " bytes of host memory at ", base,
              " (cudaHostRegister: ", ot_cuda_error_string(-result), "). Check `ulimit -l`.");
  std::lock_guard<std::mutex> lock(g_late_pinned_mutex);
  g_late_pinned.insert(base);
  return true;
#else
  return false;
#endif
}

// The device address of a pinned host tensor's first element: what a kernel reads it through (UVA,
// as masked_row_gather does). For a CUDA view of pinned memory (benchmarks' UVA offload baseline).
int64_t host_device_address(const at::Tensor& host) {
  TORCH_CHECK(host.device().is_cpu(), "offtensor: host_device_address takes a host tensor, got one on ", host.device());
#ifdef OFFTENSOR_WITH_CUDA
  void* device_ptr = nullptr;
  const int code = ot_cuda_host_device_pointer(host.data_ptr(), &device_ptr);
  TORCH_CHECK(code >= 0, "offtensor: host_device_address of a ", host.sizes(), " ", host.dtype(), " tensor (",
              host.nbytes(), " bytes) failed: ", ot_cuda_error_string(-code), " (is it in pinned memory?)");
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(device_ptr));
#else
  TORCH_CHECK(false, "offtensor: host_device_address of a ", host.sizes(), " ", host.dtype(), " tensor (", host.nbytes(),
              " bytes) needs the extension built with CUDA");
#endif
}

}  // namespace
}  // namespace offtensor
