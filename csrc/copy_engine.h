// The asynchronous copy engine: a worker thread on the emulated device, runtime.cu's copy streams
// on a GPU, one sequence of tickets for both.
// A part of offtensor.cpp's one translation unit, included there once: every file that includes ATen
// costs about a minute to compile on a 2-core build machine, so the extension's ATen code stays one
// unit, kept in files by idea. Its functions have internal linkage (an unnamed namespace).
#pragma once

#include <pthread.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops_common.h"

namespace offtensor {
namespace {

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

}  // namespace
}  // namespace offtensor
