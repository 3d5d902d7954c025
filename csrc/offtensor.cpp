// offtensor's native extension: the schemas of every torch.ops.offtensor op and their CPU
// implementations, i.e. exact-size page-aligned host memory and the asynchronous copy engine.
//
// CUDA work goes through the C interface in cuda/runtime.h (compiled by nvcc, linked only when
// OFFTENSOR_WITH_CUDA is defined), so this file needs no CUDA headers and builds against a CPU
// torch. Fake kernels live in offtensor/_ext.py. One file for everything that includes ATen: each
// such translation unit costs about a minute on a 2-core build machine. The expert policy's inner
// loops, which need only Python's headers, are csrc/policy.cpp and the files it names; the one of
// their reads that needs a tensor's own memory (score_rows, below) is here.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "score_view.h"

#ifdef OFFTENSOR_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace offtensor {
namespace {

constexpr bool kCudaCompiled =
#ifdef OFFTENSOR_WITH_CUDA
    true;
#else
    false;
#endif

int64_t cuda_device_count() {
#ifdef OFFTENSOR_WITH_CUDA
  // The answer cannot change within a process, and asking the driver costs milliseconds.
  static const int64_t count = ot_cuda_device_count();
  return count;
#else
  return 0;
#endif
}

#ifdef OFFTENSOR_WITH_CUDA
// Turns a negative code from runtime.cu into an exception naming what was being done.
void check_cuda(int64_t result, const char* what) {
  TORCH_CHECK(result >= 0, "offtensor: ", what, " failed: ", ot_cuda_error_string(static_cast<int>(-result)),
              " (CUDA error ", -result, ")");
}
#endif

// Releases the GIL while a C++ call blocks, when the calling thread holds it, so other Python
// threads keep running while we wait for a copy.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

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

// ---------------------------------------------------------------------------------------------
// Copy engine
//
// Tickets are issued by the caller (offtensor/_ext.py), so one monotonic sequence covers these
// copies and the ones _ext.py runs through torch. A ticket is finished when every copy submitted
// under it has finished; tickets never submitted read as finished.
// ---------------------------------------------------------------------------------------------

// The emulated device: one worker thread copies CPU tensors in submission order. It never touches
// Python: it keeps the tensors of finished copies in finished_, and they are released by whichever
// thread next calls into the engine, because dropping the last reference to a tensor that has a
// Python object takes the GIL, and the thread holding it may be waiting on this worker.
class CpuCopyWorker {
 public:
  void submit(int64_t ticket, at::Tensor dst, at::Tensor src) {
    Job job{ticket, dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.nbytes()), std::move(dst),
            std::move(src)};
    std::vector<Job> finished;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable()) thread_ = std::thread([this, generation = generation_] { run(generation); });
      ++in_flight_[ticket];
      queue_.push_back(std::move(job));
      finished.swap(finished_);
    }
    work_ready_.notify_one();
  }

  bool done(int64_t ticket) {
    std::vector<Job> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    finished.swap(finished_);
    return in_flight_.count(ticket) == 0;
  }

  void wait(int64_t ticket) {
    std::vector<Job> finished;
    GilRelease no_gil;
    std::unique_lock<std::mutex> lock(mutex_);
    job_done_.wait(lock, [&] { return in_flight_.count(ticket) == 0; });
    finished.swap(finished_);
  }

  // Finishes the queued copies and joins the thread. Called at interpreter exit, while Python can
  // still release the tensors; a later submit starts a new thread.
  void shutdown() {
    std::vector<Job> finished;
    GilRelease no_gil;
    std::thread retiring;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
      retiring.swap(thread_);
    }
    work_ready_.notify_all();
    if (retiring.joinable()) retiring.join();
    std::lock_guard<std::mutex> lock(mutex_);
    finished.swap(finished_);
  }

 private:
  struct Job {
    int64_t ticket;
    void* dst;
    const void* src;
    size_t nbytes;
    at::Tensor dst_tensor;  // keep both tensors' memory alive until the copy is done
    at::Tensor src_tensor;
  };

  // A thread exits once shutdown() has moved on to a new generation and the queue is empty; a
  // submit racing with shutdown() may meanwhile start the next generation's thread.
  void run(uint64_t generation) {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_ready_.wait(lock, [&] { return generation_ != generation || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      if (job.nbytes > 0) std::memcpy(job.dst, job.src, job.nbytes);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = in_flight_.find(job.ticket);
        if (--it->second == 0) in_flight_.erase(it);
        finished_.push_back(std::move(job));
      }
      job_done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable job_done_;
  std::deque<Job> queue_;
  std::unordered_map<int64_t, int> in_flight_;  // ticket -> copies submitted under it, not yet done
  std::vector<Job> finished_;
  std::thread thread_;
  uint64_t generation_ = 0;
};

// Deliberately leaked: a std::thread destroyed while joinable would abort the process at exit.
CpuCopyWorker* g_cpu_worker = new CpuCopyWorker();

// A forked child has no worker thread, and the parent's mutex may have been held at fork time, so
// the child starts with a fresh worker. Tickets still in flight at the fork read as finished there,
// but their bytes may be half-copied in the child's memory: a child must not use such copies.
void reset_worker_in_child() { g_cpu_worker = new CpuCopyWorker(); }
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, reset_worker_in_child);

#ifdef OFFTENSOR_WITH_CUDA
// Copies that involve a GPU run on runtime.cu's copy streams. This keeps their tensors alive until
// the copy's event has fired; finished entries are dropped on every call.
class CudaCopies {
 public:
  void submit(int64_t ticket, at::Tensor dst, at::Tensor src, int64_t wait_stream) {
    const at::Device device = dst.is_cuda() ? dst.device() : src.device();
    const int64_t copy = ot_cuda_copy_async(device.index(), dst.data_ptr(), src.data_ptr(),
                                            static_cast<size_t>(dst.nbytes()),
                                            reinterpret_cast<void*>(wait_stream));
    if (copy < 0) {
      TORCH_CHECK(false, "offtensor: could not enqueue a copy of ", dst.nbytes(), " bytes from ", src.device(),
                  " to ", dst.device(), ": ", ot_cuda_error_string(static_cast<int>(-copy)));
    }
    std::vector<Entry> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    collect_finished(finished);
    copies_.emplace(ticket, Entry{copy, std::move(dst), std::move(src)});
  }

  // Whether ticket names a copy this engine still tracks.
  bool tracks(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    return copies_.count(ticket) != 0;
  }

  bool done(int64_t ticket) {
    std::vector<Entry> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    collect_finished(finished);
    auto [first, end] = copies_.equal_range(ticket);
    for (auto it = first; it != end; ++it) {
      const int result = ot_cuda_query(it->second.copy);
      check_cuda(result, "waiting for a host<->device copy");
      if (result == 0) return false;
    }
    release(ticket, finished);
    return true;
  }

  void wait(int64_t ticket) {
    std::vector<Entry> finished;
    {
      GilRelease no_gil;
      for (int64_t copy : copies_of(ticket)) check_cuda(ot_cuda_sync(copy), "waiting for a host<->device copy");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    release(ticket, finished);
  }

  // Releases the tensors of finished copies; copies still running keep theirs (and are leaked at
  // exit, which is better than freeing memory a DMA engine is still writing).
  void release_finished() {
    std::vector<Entry> finished;
    std::lock_guard<std::mutex> lock(mutex_);
    collect_finished(finished);
  }

  void stream_wait(int64_t ticket, int64_t stream) {
    for (int64_t copy : copies_of(ticket)) {
      check_cuda(ot_cuda_stream_wait(copy, reinterpret_cast<void*>(stream)), "making a stream wait for a copy");
    }
  }

 private:
  struct Entry {
    int64_t copy;  // runtime.cu's ticket
    at::Tensor dst;
    at::Tensor src;
  };

  std::vector<int64_t> copies_of(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> copies;
    auto [first, end] = copies_.equal_range(ticket);
    for (auto it = first; it != end; ++it) copies.push_back(it->second.copy);
    return copies;
  }

  // Caller holds mutex_; entries move to `out` so tensors are released after the lock is dropped.
  void release(int64_t ticket, std::vector<Entry>& out) {
    auto [first, end] = copies_.equal_range(ticket);
    for (auto it = first; it != end; ++it) out.push_back(std::move(it->second));
    copies_.erase(first, end);
  }

  // Caller holds mutex_. Oldest first, stopping at the first copy still running: copies mostly
  // finish in submission order, and the rest are found by done() and wait().
  void collect_finished(std::vector<Entry>& out) {
    while (!copies_.empty() && ot_cuda_query(copies_.begin()->second.copy) == 1) {
      out.push_back(std::move(copies_.begin()->second));
      copies_.erase(copies_.begin());
    }
  }

  std::mutex mutex_;
  std::multimap<int64_t, Entry> copies_;  // ticket -> copy, ordered by ticket
};

// Leaked like the worker: destroying tensors after Python has shut down could touch Python.
CudaCopies* g_cuda_copies = new CudaCopies();
#endif

// Copies dst.nbytes() bytes from src into dst asynchronously. Returns at once; copy_query and
// copy_wait tell when dst holds the bytes. For a copy to or from a GPU the copy stream first waits
// for the work already enqueued on wait_stream (a cudaStream_t as an integer, 0 for the default
// stream): e.g. the last op reading the old contents of dst. CPU copies ignore it.
void copy_async(const at::Tensor& dst, const at::Tensor& src, int64_t ticket, int64_t wait_stream) {
  TORCH_CHECK(ticket > 0, "offtensor.copy_async: tickets are positive, got ", ticket);
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "offtensor.copy_async: dst and src must be contiguous, got dst ",
              dst.sizes(), " with strides ", dst.strides(), " and src ", src.sizes(), " with strides ", src.strides());
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "offtensor.copy_async: dst holds ", dst.nbytes(), " bytes but src holds ",
              src.nbytes(), " bytes");
  if (dst.device() == src.device() && dst.nbytes() > 0) {
    const auto dst_begin = reinterpret_cast<uintptr_t>(dst.data_ptr());
    const auto src_begin = reinterpret_cast<uintptr_t>(src.data_ptr());
    const auto nbytes = static_cast<uintptr_t>(dst.nbytes());
    TORCH_CHECK(dst_begin + nbytes <= src_begin || src_begin + nbytes <= dst_begin, "offtensor.copy_async: dst and src "
                "overlap (", nbytes, " bytes at ", dst.data_ptr(), " and ", src.data_ptr(), ")");
  }

  if (dst.is_cpu() && src.is_cpu()) {
    g_cpu_worker->submit(ticket, dst, src);
    return;
  }
  TORCH_CHECK((dst.is_cpu() || dst.is_cuda()) && (src.is_cpu() || src.is_cuda()),
              "offtensor.copy_async: copies between ", src.device(), " and ", dst.device(), " are not supported");
#ifdef OFFTENSOR_WITH_CUDA
  TORCH_CHECK(cuda_device_count() > 0, "offtensor.copy_async: got a CUDA tensor but the CUDA runtime sees no GPU");
  g_cuda_copies->submit(ticket, dst, src, wait_stream);
#else
  (void)wait_stream;
  TORCH_CHECK(false, "offtensor.copy_async: ", dst.device(), " <- ", src.device(), " needs the extension built with "
              "CUDA (nvcc on PATH or CUDA_HOME, OFFTENSOR_NO_CUDA unset); use offtensor._ext.CopyEngine, which falls "
              "back to torch");
#endif
}

bool copy_query(int64_t ticket) {
#ifdef OFFTENSOR_WITH_CUDA
  if (g_cuda_copies->tracks(ticket)) return g_cuda_copies->done(ticket);
#endif
  return g_cpu_worker->done(ticket);
}

void copy_wait(int64_t ticket) {
#ifdef OFFTENSOR_WITH_CUDA
  if (g_cuda_copies->tracks(ticket)) return g_cuda_copies->wait(ticket);
#endif
  g_cpu_worker->wait(ticket);
}

// Makes the GPU stream `stream` wait for the copy without blocking the host. The emulated device
// has no streams, so there the host waits: afterwards every later op sees the copied bytes.
void copy_stream_wait(int64_t ticket, int64_t stream) {
#ifdef OFFTENSOR_WITH_CUDA
  if (g_cuda_copies->tracks(ticket)) return g_cuda_copies->stream_wait(ticket, stream);
#else
  (void)stream;
#endif
  g_cpu_worker->wait(ticket);
}

// Called at interpreter exit (see _ext.py), while Python can still release tensors.
void copy_shutdown() {
  g_cpu_worker->shutdown();
#ifdef OFFTENSOR_WITH_CUDA
  g_cuda_copies->release_finished();
#endif
}

// The expert pool's fetch (offtensor/ops/expert_pool.py): dst[dest[e]] = src[e] for every row e of
// src whose dest[e] is a slot of dst (0 <= dest[e] < dst.size(0)); other rows copy nothing. src is a
// host master (pinned: read by the GPU through its device address), dst a device buffer, dest an
// int64 tensor on dst's device. The CPU kernel is the emulated device's own gather.
void check_rows(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "offtensor: masked_row_gather needs contiguous ",
              "rows, got a ", dst.sizes(), " pool buffer and a ", src.sizes(), " host stack");
  TORCH_CHECK(dst.dtype() == src.dtype() && dst.dim() >= 1 && src.dim() == dst.dim() && src.size(0) > 0 &&
                  dst.numel() / std::max<int64_t>(dst.size(0), 1) == src.numel() / src.size(0),
              "offtensor: masked_row_gather: a ", src.sizes(), " ", src.dtype(), " stack does not fit a ",
              dst.sizes(), " ", dst.dtype(), " pool");
}

size_t row_bytes_of(const at::Tensor& src) { return static_cast<size_t>(src.numel() / src.size(0)) * src.element_size(); }

void check_gather(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& dest) {
  check_rows(dst, src);
  TORCH_CHECK(dest.dtype() == at::kLong && dest.dim() == 1 && dest.size(0) == src.size(0),
              "offtensor: masked_row_gather: dest must be int64 with one entry per row of the ", src.sizes(),
              " stack, got ", dest.sizes(), " ", dest.dtype());
}

void masked_row_gather_cpu(at::Tensor dst, const at::Tensor& src, const at::Tensor& dest, int64_t stream) {
  (void)stream;
  check_gather(dst, src, dest);
  const int64_t rows = src.size(0), slots = dst.size(0);
  const size_t row_bytes = row_bytes_of(src);
  const int64_t* to = dest.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* out = static_cast<char*>(dst.data_ptr());
  for (int64_t e = 0; e < rows; ++e) {
    const int64_t slot = to[e];
    if (slot >= 0 && slot < slots) std::memcpy(out + slot * row_bytes, from + e * row_bytes, row_bytes);
  }
}

#ifdef OFFTENSOR_WITH_CUDA
void masked_row_gather_cuda(at::Tensor dst, const at::Tensor& src, const at::Tensor& dest, int64_t stream) {
  check_gather(dst, src, dest);
  TORCH_CHECK(src.device().is_cpu(), "offtensor: masked_row_gather reads a host stack, got one on ", src.device());
  const size_t row_bytes = row_bytes_of(src);
  const int code = ot_cuda_masked_row_gather(dst.get_device(), dst.data_ptr(), src.data_ptr(),
                                             dest.data_ptr<int64_t>(), src.size(0), dst.size(0), row_bytes,
                                             reinterpret_cast<void*>(stream));
  TORCH_CHECK(code >= 0, "offtensor: masked_row_gather of a ", src.sizes(), " host stack failed: ",
              ot_cuda_error_string(-code), " (is the stack in pinned memory?)");
}
#endif

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

// The expert pool's admit on the emulated device, in one call, with the call's grouped-GEMM plan
// (offtensor/ops/expert_pool.py: pool_admit then _compact_plan are the same decisions as
// fixed-shape tensor ops, the form a GPU runs). `offs`: the cumulative group ends of a grouped GEMM
// of `rows` rows sorted by expert, of the layer whose `experts` experts start at `base` in slot_of.
// The experts with rows are admitted by LRU (protect the held ones; each missed one, in expert
// order, takes the unprotected slot of the oldest stamp, empty slots first, lowest index on ties),
// the missed ones copied from their host stacks into the slot buffers. Returns (each group's slot,
// the groups' ends), one group per distinct expert in expert order, min(rows, experts) groups.
// `counts` (fetches, hits) gains the missed and the held experts. All checks come before the first
// write, so the tables are never left half-changed.
std::tuple<at::Tensor, at::Tensor> pool_admit_cpu(const at::Tensor& offs, int64_t rows, at::Tensor slot_of,
                                                  at::Tensor expert_in, at::Tensor stamp, at::Tensor clock,
                                                  at::Tensor counts, at::TensorList buffers, at::TensorList hosts,
                                                  int64_t base, int64_t experts) {
  TORCH_CHECK(offs.dtype() == at::kInt && offs.is_contiguous() && offs.size(0) == experts,
              "offtensor: pool_admit takes int32 group ends, one per expert, got ", offs.sizes(), " ", offs.dtype());
  TORCH_CHECK(slot_of.dtype() == at::kLong && expert_in.dtype() == at::kLong && stamp.dtype() == at::kLong &&
                  clock.dtype() == at::kLong && counts.dtype() == at::kLong && counts.numel() == 2 &&
                  counts.is_contiguous() && slot_of.is_contiguous() && expert_in.is_contiguous() &&
                  stamp.is_contiguous() && buffers.size() == hosts.size(),
              "offtensor: pool_admit takes contiguous int64 tables and one host stack per buffer");
  const int64_t slots = expert_in.size(0) - 1, total = slot_of.size(0) - 1;
  TORCH_CHECK(base >= 0 && base + experts <= total && stamp.size(0) == slots + 1,
              "offtensor: pool_admit: a layer of ", experts, " experts at ", base, " does not fit a table of ", total);
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_rows(buffers[i], hosts[i]);
    TORCH_CHECK(hosts[i].size(0) == experts && buffers[i].size(0) == slots,
                "offtensor: pool_admit: a ", hosts[i].sizes(), " stack for a layer of ", experts, " experts and ",
                slots, " slots");
  }
  const int32_t* ends = offs.data_ptr<int32_t>();
  int64_t* slot = slot_of.data_ptr<int64_t>() + base;
  int64_t* holder = expert_in.data_ptr<int64_t>();
  int64_t* last = stamp.data_ptr<int64_t>();
  std::vector<char> needed(experts, 0), guarded(slots, 0);
  int64_t misses = 0, hits = 0, previous = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t end = std::min<int64_t>(ends[e], rows);
    needed[e] = end > previous;
    previous = std::max(previous, end);
    if (!needed[e]) continue;
    if (slot[e] >= 0) guarded[slot[e]] = 1, ++hits; else ++misses;
  }
  std::vector<int64_t> free_slots;
  for (int64_t s = 0; s < slots; ++s)
    if (!guarded[s]) free_slots.push_back(s);
  TORCH_CHECK(misses <= static_cast<int64_t>(free_slots.size()), "offtensor: pool_admit: ", misses,
              " missed experts for ", free_slots.size(), " free slots");
  std::stable_sort(free_slots.begin(), free_slots.end(), [&](int64_t a, int64_t b) { return last[a] < last[b]; });
  std::vector<int64_t> dest(experts, slots);
  int64_t rank = 0;
  for (int64_t e = 0; e < experts; ++e)
    if (needed[e] && slot[e] < 0) dest[e] = free_slots[rank++];
  for (int64_t e = 0; e < experts; ++e) {  // 1. the taken slots leave their old experts
    if (dest[e] == slots) continue;
    const int64_t old = holder[dest[e]];
    if (old >= 0) slot_of.data_ptr<int64_t>()[old] = -1;
    holder[dest[e]] = -1;
  }
  for (size_t i = 0; i < buffers.size(); ++i) {  // 2. the missed experts' bytes
    const size_t row_bytes = row_bytes_of(hosts[i]);
    const char* from = static_cast<const char*>(hosts[i].data_ptr());
    char* to = static_cast<char*>(buffers[i].data_ptr());
    for (int64_t e = 0; e < experts; ++e)
      if (dest[e] < slots) std::memcpy(to + dest[e] * row_bytes, from + e * row_bytes, row_bytes);
  }
  const int64_t now = clock.data_ptr<int64_t>()[0];
  const int64_t groups = std::min(rows, experts);
  at::Tensor group_slot = at::zeros({groups}, slot_of.options());
  at::Tensor group_ends = at::empty({groups}, offs.options());
  int64_t* gs = group_slot.data_ptr<int64_t>();
  int32_t* ge = group_ends.data_ptr<int32_t>();
  int64_t group = 0;
  int32_t covered = 0;
  for (int64_t e = 0; e < experts; ++e) {  // 3. slots to their new experts, experts to their slots
    if (dest[e] < slots) {
      holder[dest[e]] = base + e;
      slot[e] = dest[e];
    }
    if (!needed[e]) continue;
    last[slot[e]] = now;
    covered = static_cast<int32_t>(std::min<int64_t>(ends[e], rows));
    gs[group] = slot[e];
    ge[group++] = covered;
  }
  for (; group < groups; ++group) ge[group] = covered;
  clock.data_ptr<int64_t>()[0] = now + 1;
  counts.data_ptr<int64_t>()[0] += misses;
  counts.data_ptr<int64_t>()[1] += hits;
  return std::make_tuple(group_slot, group_ends);
}

// The emulated device's grouped GEMM of a pooled call (offtensor/ops/expert_pool.py), with no copy of
// the slots it reads: group g (rows [ends[g-1], ends[g])) against slot group_slot[g] of `pool` (the
// pool's buffer in the layout the op passed the stack in). Each group is the at::mm_out that
// aten's CPU _grouped_mm runs for it, on the same row slice and a matrix of the same strides, so the
// rows are bit-identical to the plain model's call; rows past the last group end are left as they
// are, as there. `ends` and `group_slot` are read on the host (they live there on this device).
at::Tensor pool_grouped_mm_cpu(const at::Tensor& x, const at::Tensor& pool, const at::Tensor& group_slot,
                               const at::Tensor& ends) {
  TORCH_CHECK(x.dim() == 2 && pool.dim() == 3 && x.size(1) == pool.size(1) && x.scalar_type() == pool.scalar_type(),
              "offtensor: pool_grouped_mm takes (rows, k) rows and (slots, k, n) slots of one dtype, got ", x.sizes(),
              " ", x.dtype(), " and ", pool.sizes(), " ", pool.dtype());
  TORCH_CHECK(ends.dtype() == at::kInt && group_slot.dtype() == at::kLong && ends.is_contiguous() &&
                  group_slot.is_contiguous() && ends.numel() == group_slot.numel(),
              "offtensor: pool_grouped_mm takes int32 group ends and one int64 slot per group");
  const int64_t groups = ends.numel(), slots = pool.size(0), rows = x.size(0);
  const int32_t* end = ends.data_ptr<int32_t>();
  const int64_t* slot = group_slot.data_ptr<int64_t>();
  for (int64_t g = 0, start = 0; g < groups; start = end[g++])  // all checks before the first GEMM
    TORCH_CHECK(end[g] >= start && end[g] <= rows && slot[g] >= 0 && slot[g] < slots,
                "offtensor: pool_grouped_mm: group ", g, " ends at ", end[g], " of ", rows, " rows in slot ", slot[g],
                " of ", slots);
  at::Tensor out = at::empty({rows, pool.size(2)}, x.options());
  for (int64_t g = 0, start = 0; g < groups; start = end[g++])
    if (end[g] > start) {
      at::Tensor rows_out = out.slice(0, start, end[g]);
      at::mm_out(rows_out, x.slice(0, start, end[g]), pool.select(0, slot[g]));
    }
  return out;
}

bool cuda_compiled() { return kCudaCompiled; }

}  // namespace

// A routing guess's few rows of look-ahead scores read on the host (csrc/guesses.cpp), from the
// tensor's memory: each value as tolist() gives it (a float, half or bfloat16 widened to a double,
// exactly), without a Python float made per value and freed after (a tolist() of a decode step's
// scores and its list's release were a sixth of the guess path's host work), and only the columns
// a read asks for. ``score_view``: 1 with a 1- or 2-D strided CPU tensor of float, double, half or
// bfloat16 (its layout in ``view``; the caller holds the tensor while it reads), 0, no exception
// set, for anything else (the caller reads it through tolist()). Nothing here throws: every ATen
// call it makes is a plain read of the tensor's metadata.
int score_view(PyObject* obj, ScoreView* view) {
  if (!THPVariable_Check(obj)) return 0;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || t.is_conj() ||
      (t.dim() != 1 && t.dim() != 2) || !t.has_storage())
    return 0;
  const at::ScalarType type = t.scalar_type();
  if (type != at::kFloat && type != at::kDouble && type != at::kHalf && type != at::kBFloat16) return 0;
  view->rows = t.dim() == 2 ? t.size(0) : 1;
  view->cols = t.size(-1);
  view->row_stride = t.dim() == 2 ? t.stride(0) : 0;
  view->col_stride = t.stride(-1);
  view->type = type == at::kFloat ? 0 : type == at::kDouble ? 1 : type == at::kHalf ? 2 : 3;
  view->data = view->rows * view->cols != 0 ? t.const_data_ptr() : nullptr;
  return 1;
}

namespace {
template <typename T>
void widen(const ScoreView& view, int64_t row, int64_t lo, int64_t count, double* out) {
  const T* first = static_cast<const T*>(view.data) + row * view.row_stride + lo * view.col_stride;
  for (int64_t c = 0; c < count; ++c) out[c] = static_cast<float>(first[c * view.col_stride]);
}
}  // namespace

// Columns [lo, lo + count) of row ``row`` of a view score_view made, as doubles (double: as they are).
void score_values(const ScoreView& view, int64_t row, int64_t lo, int64_t count, double* out) {
  switch (view.type) {
    case 0: return widen<float>(view, row, lo, count, out);
    case 1: {
      const double* first = static_cast<const double*>(view.data) + row * view.row_stride + lo * view.col_stride;
      for (int64_t c = 0; c < count; ++c) out[c] = first[c * view.col_stride];
      return;
    }
    case 2: return widen<c10::Half>(view, row, lo, count, out);
    default: return widen<c10::BFloat16>(view, row, lo, count, out);
  }
}

}  // namespace offtensor

TORCH_LIBRARY(offtensor, m) {
  m.def("alloc_host(SymInt nbytes, bool pin, bool touch=True) -> Tensor");
  m.def("pin_host(Tensor host) -> bool");
  m.def("copy_async(Tensor(a!) dst, Tensor src, int ticket, int wait_stream) -> ()");
  // Ops without tensor arguments run the same everywhere, so they get one catch-all kernel.
  m.def("copy_query(int ticket) -> bool", &offtensor::copy_query);
  m.def("copy_wait(int ticket) -> ()", &offtensor::copy_wait);
  m.def("copy_stream_wait(int ticket, int stream) -> ()", &offtensor::copy_stream_wait);
  m.def("copy_shutdown() -> ()", &offtensor::copy_shutdown);
  m.def("live_host_bytes() -> int", &offtensor::live_host_bytes);
  m.def("cuda_device_count() -> int", &offtensor::cuda_device_count);
  m.def("cuda_compiled() -> bool", &offtensor::cuda_compiled);
  m.def("masked_row_gather(Tensor(a!) dst, Tensor src, Tensor dest, int stream) -> ()");
  m.def("host_device_address(Tensor host) -> int");
  m.def("pool_admit_cpu(Tensor offs, int rows, Tensor(a!) slot_of, Tensor(b!) expert_in, Tensor(c!) stamp, "
        "Tensor(d!) clock, Tensor(e!) counts, Tensor(f!)[] buffers, Tensor[] hosts, int base, int experts) -> "
        "(Tensor, Tensor)");
  m.def("pool_grouped_mm_cpu(Tensor x, Tensor pool, Tensor group_slot, Tensor group_ends) -> Tensor");
}

// A factory has no tensor argument to dispatch on; CompositeExplicitAutograd (unlike a catch-all
// kernel) still leaves FakeTensorMode to the fake kernel registered in Python.
TORCH_LIBRARY_IMPL(offtensor, CompositeExplicitAutograd, m) { m.impl("alloc_host", &offtensor::alloc_host); }

TORCH_LIBRARY_IMPL(offtensor, CPU, m) {
  m.impl("copy_async", &offtensor::copy_async);
  m.impl("pin_host", &offtensor::pin_host);
  m.impl("masked_row_gather", &offtensor::masked_row_gather_cpu);
  m.impl("host_device_address", &offtensor::host_device_address);
  m.impl("pool_admit_cpu", &offtensor::pool_admit_cpu);
  m.impl("pool_grouped_mm_cpu", &offtensor::pool_grouped_mm_cpu);
}

TORCH_LIBRARY_IMPL(offtensor, CUDA, m) {
  m.impl("copy_async", &offtensor::copy_async);
#ifdef OFFTENSOR_WITH_CUDA
  m.impl("masked_row_gather", &offtensor::masked_row_gather_cuda);
#endif
}

namespace offtensor {
PyMethodDef* policy_methods();  // csrc/policy.cpp
}

// `import offtensor._C` loads this library, whose static initializers register the ops above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "offtensor's native ops, in torch.ops.offtensor",
                                      -1, offtensor::policy_methods(), nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
